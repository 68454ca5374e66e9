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
from tests.support.ray_data import InProcessDataset


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
        # inputs finish in order: a, then b, then c; one after the input that dies waits far longer
        # (cancelled when the batch dies), so a loaded host cannot let it finish in the same loop pass
        after_death = self.dies_at is not None and i > list(batch["input"]).index(self.dies_at)
        await asyncio.sleep(5.0 if after_death else 0.01 * i)
        if name == self.dies_at:
            raise ProcessDied(name)
        self.answered.append(name)
        return {"input": name, "caption": f"cap {name}", "error": None if name != "c" else "broken",
                "completion_tokens": 3}

    def outcome(self, row):
        return row["error"], row["completion_tokens"]

    def crashed(self, batch, i, message):
        return {"input": str(batch["input"][i]), "caption": None, "error": message, "completion_tokens": 0}


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


def test_ray_jobs_hold_the_outputs_lock_from_resume_to_merge(tmp_path, monkeypatch):
    """``--ray`` jobs took no lock: two of them (or one and a single-process job) on one output each
    ran nearly every input again and merged over each other.  Ray Data is replaced by a stand-in
    that journals a row per input, as the replicas do."""
    from mm_pipeline.cluster import batch_dataset, caption_dataset
    from mm_pipeline.cluster.distributed_job import DistributedResult, RayJobConfig
    from mm_pipeline.jobs.caption import CaptionConfig
    from mm_pipeline.jobs.resume import OutputFileError, open_output
    from mm_pipeline.jobs.shard_journal import ShardJournal

    def run_replicas(ds, replica_cls, kwargs, config, on_result, progress=None):
        output = kwargs["spec"].output
        with pytest.raises(OutputFileError, match="being written by another job"):
            open_output(output.path)  # a second job on the output, while this one runs
        journal = ShardJournal(output.shard_path("r1"))
        for item in ds:  # a caption input, or a batch line (its bytes, from the read stage)
            key = item.get("input") or json.loads(item["raw"])["custom_id"]
            journal.append({output.key: key, "error": None})
            on_result(key, None, 0)
        return DistributedResult(replicas=[], results=len(ds), duplicate_results=0, journaled=0)

    ray = SimpleNamespace(data=SimpleNamespace(from_items=InProcessDataset.from_items,
                                               TaskPoolStrategy=lambda size: None))
    for module in (caption_dataset, batch_dataset):
        monkeypatch.setattr(module, "run_replicas", run_replicas)
        monkeypatch.setattr(module, "configure_data", lambda config, default_read_ahead_bytes: None)
    engine = SimpleNamespace(limits=SimpleNamespace(max_bytes=None))
    config = RayJobConfig()

    spec = ReplicaSpec(model_dir="unused", engine_config=engine, output=JobOutput(tmp_path / "c.jsonl", key="input"))
    summary, result = caption_dataset.run_caption_on_ray(ray, ["a", "b"], spec, CaptionConfig(), config)
    assert summary.succeeded == 2 and result.merge.rows == 2
    with open_output(spec.output.path):  # the output is another job's: refused before Ray is asked
        with pytest.raises(OutputFileError, match="being written by another job"):
            caption_dataset.run_caption_on_ray(None, ["a", "b", "c"], spec, CaptionConfig(), config)

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c}) + "\n" for c in ("x", "y")))
    spec = ReplicaSpec(model_dir="unused", engine_config=engine, output=JobOutput(tmp_path / "b.jsonl", key="custom_id"))
    summary, result = batch_dataset.run_batch_on_ray(ray, src, spec, config)
    assert summary.succeeded == 2 and result.merge.rows == 2
    with open_output(spec.output.path):
        with pytest.raises(OutputFileError, match="being written by another job"):
            batch_dataset.run_batch_on_ray(None, src, spec, config)
    open_output(spec.output.path).close()  # each job let the lock go when it ended
