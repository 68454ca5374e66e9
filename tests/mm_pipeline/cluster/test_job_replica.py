"""The replicas' batch protocol without Ray or a model: a replica that dies mid-batch leaves the
rows it finished in its shard, and the retried batch -- on the restarted replica (same actor id,
same shard) or on another one -- redoes only the inputs without a row."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from mm_pipeline.cluster.job_replica import RESULT_COLUMNS, JobReplica, ReplicaSpec
from mm_pipeline.jobs.job_output import JobOutput


class ProcessDied(Exception):
    """Stands for the replica's process dying: the batch returns nothing."""


class FakeReplica(JobReplica):
    def __init__(self, spec: ReplicaSpec, actor_id: str, dies_at: str | None = None) -> None:
        self.actor_id, self.dies_at, self.answered = actor_id, dies_at, []
        super().__init__(spec)

    def identity(self) -> tuple[str, str]:
        return self.actor_id, "node-a"

    def load_engine(self, spec: ReplicaSpec) -> SimpleNamespace:
        return SimpleNamespace(stats=lambda: None)

    def keys(self, batch):
        return [str(k) for k in batch["input"]]

    async def answer(self, batch, i, n):
        name = str(batch["input"][i])
        await asyncio.sleep(0.01 * i)  # inputs finish in order: a, then b, then c
        if name == self.dies_at:
            raise ProcessDied(name)
        self.answered.append(name)
        return {"input": name, "caption": f"cap {name}", "error": None if name != "c" else "broken",
                "completion_tokens": 3}

    def outcome(self, row):
        return row["error"], row["completion_tokens"]


@pytest.mark.parametrize("retried_on", ["actor-1", "actor-2"])  # the restarted replica, or another
def test_a_retried_batch_redoes_only_unfinished_inputs(tmp_path, retried_on):
    output = JobOutput(tmp_path / "out.jsonl", key="input")
    spec = ReplicaSpec(model_dir="unused", engine_config=None, output=output)
    batch = {"input": np.array(["a", "b", "c"], dtype=object)}
    first = FakeReplica(spec, "actor-1", dies_at="b")
    with pytest.raises(ProcessDied):
        asyncio.run(first(batch))
    assert first.answered == ["a"]
    retry = FakeReplica(spec, retried_on)
    result = asyncio.run(retry(batch))
    assert retry.answered == ["b", "c"]  # a was done before the death
    assert set(result) == set(RESULT_COLUMNS)
    assert result["journaled"] == [True, False, False]
    assert result["error"] == ["", "", "broken"] and result["tokens"] == [3, 3, 3]
    rows = [json.loads(ln) for shard in output.shard_paths() for ln in shard.read_text().splitlines()]
    assert sorted(r["input"] for r in rows) == ["a", "b", "c"]  # each once across the shards
    assert output.merge(["a", "b", "c"]).duplicates == 0
