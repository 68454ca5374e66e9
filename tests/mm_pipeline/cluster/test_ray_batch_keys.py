"""``batch --ray`` keys every line as ``batch`` does, without Ray or a model: the real plan_input /
read_chunks / BatchReplica / merge, with Ray Data replaced by an in-process stand-in (one replica,
batches of ``batch_size`` lines) and the engine by a service that answers every request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mm_pipeline.cluster import batch_dataset
from mm_pipeline.cluster.batch_replica import BatchReplica
from mm_pipeline.cluster.distributed_job import DistributedResult, RayJobConfig
from mm_pipeline.cluster.job_replica import ReplicaSpec
from mm_pipeline.jobs.job_output import JobOutput
from mm_pipeline.server.batches.lines import answer_line
from tests.support.ray_data import InProcessDataset


class ReplicaDied(Exception):
    """Stands for the replica's process dying mid-batch."""


class _Service:
    async def chat(self, request):
        return SimpleNamespace(id="chatcmpl-1", model_dump=lambda: {"usage": {"completion_tokens": 1}})

    complete = chat


class _Replica(BatchReplica):
    answered: list[int] = []  # line numbers answered, over every replica of a run
    dies_after: int | None = None  # answers before the process "dies" (then the batch is retried)
    poison: int | None = None  # the line number whose answer kills the process, every time

    def identity(self) -> tuple[str, str]:
        return "actor-1", "node-a"

    def load_engine(self, spec: ReplicaSpec) -> SimpleNamespace:
        return SimpleNamespace(stats=lambda: None)

    def __init__(self, spec: ReplicaSpec, **_: object) -> None:
        super().__init__(spec, None)
        self.job = SimpleNamespace(answer=self._answer)

    async def _answer(self, line):
        if _Replica.dies_after is not None and len(_Replica.answered) >= _Replica.dies_after:
            _Replica.dies_after = None
            raise ReplicaDied(line.number)
        if line.number == _Replica.poison:
            raise ReplicaDied(line.number)
        _Replica.answered.append(line.number)
        return await answer_line(_Service(), line)


def _run_replicas(ds, replica_cls, kwargs, config, on_result, progress=None):
    """Ray Data's part: batches to a replica; a batch whose replica died goes to a new one (Ray's
    restart keeps the actor id, hence the shard)."""
    replica = _Replica(**kwargs)
    for i in range(0, len(ds), config.batch_size):
        part = ds[i:i + config.batch_size]
        batch = {"number": np.array([r["number"] for r in part]),
                 "raw": np.array([r["raw"] for r in part], dtype=object)}
        for _ in range(10):  # Ray's retries: bounded here, so a job that would retry forever fails
            try:
                out = asyncio.run(replica(batch))
                break
            except ReplicaDied:
                replica = _Replica(**kwargs)
        else:
            raise AssertionError("the batch was retried 10 times")
        for key, error, tokens in zip(out["key"], out["error"], out["tokens"]):
            on_result(key, error or None, tokens)
    return DistributedResult(replicas=[], results=len(ds), duplicate_results=0, journaled=0)


@pytest.fixture
def ray_batch(monkeypatch):
    monkeypatch.setattr(batch_dataset, "run_replicas", _run_replicas)
    monkeypatch.setattr(batch_dataset, "configure_data", lambda *a: None)
    monkeypatch.setattr(_Replica, "answered", [])
    monkeypatch.setattr(_Replica, "poison", None)
    ray = SimpleNamespace(data=SimpleNamespace(from_items=InProcessDataset.from_items, TaskPoolStrategy=lambda size: None))

    def run(src: Path, out: Path, batch_size: int = 2):
        spec = ReplicaSpec(model_dir="unused", engine_config=None, output=JobOutput(out, key="custom_id"))
        return batch_dataset.run_batch_on_ray(ray, src, spec, RayJobConfig(batch_size=batch_size))

    return run


def _request(cid: str | None, text: str = "hi") -> str:
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": text}]}}
    return json.dumps({"custom_id": cid, **line} if cid is not None else line)


def _rows(path: Path) -> list[tuple[str | None, int | None]]:
    """(custom_id, error.line) of each output row."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [(r["custom_id"], (r["error"] or {}).get("line")) for r in rows]


def test_a_line_with_a_lone_surrogate_escape_finishes(tmp_path, ray_batch):
    """The line's quick read found custom_id "y" where the full parse refuses the line (its error row
    has none): the merge waited for a "y" row forever (IncompleteJobError on every run)."""
    bad = '{"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [' \
          '{"role": "user", "content": "a\\ud800b"}]}}'
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([_request("x"), bad, _request("z")]) + "\n")
    summary, result = ray_batch(src, out)
    assert (summary.succeeded, summary.failed, result.merge.rows) == (2, 1, 3)
    assert set(_rows(out)) == {("x", None), (None, 2), ("z", None)}
    assert [json.loads(ln)["error"]["code"] for ln in out.read_text().splitlines()
            if json.loads(ln)["error"]] == ["invalid_json"]


def test_lines_without_a_custom_id_are_answered_once_in_input_order(tmp_path, ray_batch):
    """``batch --ray`` ran a line without a custom_id again on every rerun (the plan skipped only by
    id), adding its error row each time, after the rows of the other lines.  It is now known by its
    line number (``error.line``), as ``batch`` knows it."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([_request("x"), "this is not json", _request(None), _request("z")]) + "\n")
    want = [("x", None), (None, 2), (None, 3), ("z", None)]
    summary, _ = ray_batch(src, out)
    assert (summary.succeeded, summary.failed) == (2, 2)
    assert _rows(out) == want
    for _ in range(2):
        summary, result = ray_batch(src, out)
        assert (summary.skipped, result.merge.new_rows) == (4, 0)
        assert _rows(out) == want
    assert _Replica.answered == [1, 2, 3, 4]


def test_a_retried_batch_does_not_answer_a_keyless_line_again(tmp_path, ray_batch):
    """The replica dies after answering lines 1-3 (the batch of 2-3 half done): the retried batch
    found line 2's row under no key and answered it again, and the merge kept both rows."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(["not json", _request("b"), "{}", _request(None), _request("e")]) + "\n")
    _Replica.dies_after = 3
    ray_batch(src, out)
    assert sorted(_Replica.answered) == [1, 2, 3, 4, 5]  # each once, though line 4 died once
    assert _rows(out) == [(None, 1), ("b", None), (None, 3), (None, 4), ("e", None)]


def test_a_line_that_kills_its_replica_every_time_gets_an_error_row(tmp_path, ray_batch):
    """Its batch was retried forever; now the line's second death gives it a replica_crashed row,
    named by custom_id or (without one) by its line number, and the job finishes."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_request("a"), _request(None), _request("c"), _request("d")]) + "\n")
    for poison, codes in ((2, [None, "replica_crashed", None, None]),
                          (3, [None, "missing_custom_id", "replica_crashed", None])):
        _Replica.poison = poison
        out = tmp_path / f"out{poison}.jsonl"
        summary, result = ray_batch(src, out)
        rows = [json.loads(ln) for ln in out.read_text().splitlines()]
        assert [(r["error"] or {}).get("code") for r in rows] == codes
        assert _rows(out) == [("a", None), (None, 2), ("c", 3) if poison == 3 else ("c", None), ("d", None)]
        assert "died 2 times" in rows[poison - 1]["error"]["message"]
        assert (summary.failed, result.merge.rows) == (4 - codes.count(None), 4)
