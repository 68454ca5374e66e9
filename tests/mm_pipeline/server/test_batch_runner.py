"""The batch runner (``/v1/batches``, batches/runner.py) on a fake ChatService, without a model: a
line the engine has no room for waits instead of failing; cancel ends a batch at the right time with
the right status; a failure names its cause and leaves no file behind. A line's limits and what a
batch keeps: test_batch_validation.py; expiry: test_batch_expiry.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from mm_pipeline.errors import OverloadedError, ServerBusy
from mm_pipeline.server.batches import lines as batch_lines
from mm_pipeline.server.batches import runner as batch_runner
from mm_pipeline.server.batches.result_files import ResultFiles
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FilesStore, UploadTooLarge, UploadWriter
from tests.support.batches import URL, FakeService, create_body, finished, line, rows, until, upload


# ---- 3. under load a line waits -----------------------------------------------------------------------
def test_a_line_the_engine_has_no_room_for_waits_and_is_sent_again(store, monkeypatch):
    monkeypatch.setattr(batch_lines, "RETRY_FIRST_S", 0.001)
    refusals = {"a": 3, "b": 2}

    async def full(text):
        if refusals.get(text):
            refusals[text] -= 1
            raise (OverloadedError if text == "a" else ServerBusy)("no room")

    async def main():
        svc = FakeService(full)
        runner = BatchRunner(svc, store, 2)
        return svc, await finished(runner, runner.create(create_body(upload(store, [line("a"), line("b")]))).id)

    svc, batch = asyncio.run(main())
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.error_file_id is None
    assert sorted(svc.started) == ["a"] * 4 + ["b"] * 3


def test_a_line_waiting_for_room_when_the_batch_expires_is_batch_expired(store, monkeypatch):
    monkeypatch.setattr(batch_lines, "RETRY_FIRST_S", 0.001)

    async def main():
        runner = BatchRunner(None, store, 1)

        async def full(text):
            runner.get(batch_id).expires_at = int(time.time()) - 1
            raise OverloadedError("no room")

        runner.service = FakeService(full)
        batch_id = runner.create(create_body(upload(store, [line("a"), line("b")]))).id
        return await finished(runner, batch_id)

    batch = asyncio.run(main())
    assert batch.status == "expired" and batch.request_counts.failed == 2
    assert [(r["custom_id"], r["error"]["code"]) for r in rows(store, batch.error_file_id)] == [
        ("a", "batch_expired"), ("b", "batch_expired")]


# ---- 4-6. cancel ----------------------------------------------------------------------------------------
def test_a_cancel_while_finalizing_is_refused_and_the_batch_completes(store, monkeypatch):
    writing, go = threading.Event(), threading.Event()
    commit = ResultFiles.commit
    monkeypatch.setattr(ResultFiles, "commit", lambda self: writing.set() or go.wait(10) and commit(self))

    async def main():
        runner = BatchRunner(FakeService(), store, 2)
        batch = runner.create(create_body(upload(store, [line("a"), line("b")])))
        await until(writing.is_set)
        assert batch.status == "finalizing"
        with pytest.raises(APIError) as exc:
            runner.cancel(batch.id)
        go.set()
        return exc.value, await finished(runner, batch.id)

    refused, batch = asyncio.run(main())
    assert refused.status == 409 and "is finalizing" in refused.message
    assert batch.status == "completed" and batch.cancelling_at is None and batch.output_file_id


def test_a_line_read_while_the_batch_is_cancelled_does_not_start(store, monkeypatch):
    reading_second, go = threading.Event(), threading.Event()
    read, passes = batch_runner.read_lines, []

    def slow_second(path, max_bytes):  # the runner's pass over the file (validation.py reads its own)
        passes.append(path)
        for n, raw in read(path, max_bytes):
            if n == 2 and len(passes) == 1:
                reading_second.set()
                go.wait(10)
            yield n, raw

    monkeypatch.setattr(batch_runner, "read_lines", slow_second)

    async def main():
        svc = FakeService()
        runner = BatchRunner(svc, store, 1)
        batch = runner.create(create_body(upload(store, [line(f"l{i}") for i in range(4)])))
        await until(reading_second.is_set)
        runner.cancel(batch.id)
        go.set()
        return svc, await finished(runner, batch.id)

    svc, batch = asyncio.run(main())
    assert batch.status == "cancelled" and svc.started == ["l0"] and batch.request_counts.completed == 1


def test_a_waiting_batch_is_cancelled_or_expires_at_once_and_stops_counting(store, monkeypatch):
    monkeypatch.setattr(batch_runner, "MAX_PENDING_BATCHES", 3)

    async def main():
        release = asyncio.Event()

        async def hold(text):
            await release.wait()

        runner = BatchRunner(FakeService(hold), store, 1)
        running = runner.create(create_body(upload(store, [line("run")])))
        waiting = runner.create(create_body(upload(store, [line("wait")])))
        late = runner.create(create_body(upload(store, [line("late")])))
        await until(lambda: running.status == "in_progress")
        cancelled = runner.cancel(waiting.id)
        assert cancelled.status == "cancelled" and cancelled.cancelling_at and cancelled.cancelled_at
        assert cancelled.output_file_id is None and cancelled.error_file_id is None  # OpenAI gives none
        late.expires_at = int(time.time()) - 1
        assert runner.get(late.id).status == "finalizing"  # no longer waiting: its error file is being written
        assert (await finished(runner, late.id)).status == "expired"
        runner.create(create_body(upload(store, [line("fits")])))  # two places freed: no 429
        last = runner.create(create_body(upload(store, [line("fits too")])))
        release.set()
        await finished(runner, last.id)
        return runner

    runner = asyncio.run(main())
    assert [b.status for b in runner.list(10, None).data] == ["completed", "completed", "expired", "cancelled",
                                                                "completed"]


# ---- 7-9. failures ------------------------------------------------------------------------------------
def test_a_failure_names_the_error_not_the_task_group(tmp_path):
    store = FilesStore(tmp_path, max_file_bytes=1500, max_total_bytes=1 << 20)

    async def main():
        runner = BatchRunner(FakeService(), store, 2)
        return await finished(runner, runner.create(create_body(upload(store, [line(f"c{i}") for i in range(8)]))).id)

    batch = asyncio.run(main())
    assert batch.status == "failed"
    assert batch.errors.data[0].message.startswith("the results do not fit the file store: file is larger than "
                                                   "the 1500-byte")


def test_a_failed_commit_leaves_no_file_behind(store, monkeypatch):
    commit = UploadWriter.commit

    def full_for_errors(self):
        if self.filename.endswith("_error.jsonl"):
            self.discard()
            raise UploadTooLarge("the file store is full")
        return commit(self)

    monkeypatch.setattr(UploadWriter, "commit", full_for_errors)

    async def main():
        runner = BatchRunner(FakeService(), store, 1)
        bad = json.dumps({"custom_id": "bad", "url": URL, "body": {"messages": "x"}})
        return await finished(runner, runner.create(create_body(upload(store, [line("ok"), bad]))).id)

    batch = asyncio.run(main())
    assert batch.status == "failed" and batch.output_file_id is None and "store is full" in batch.errors.data[0].message
    assert [f.purpose for f in store.list()] == ["batch"]
    store.check_integrity()
