"""Expiry in the batch runner (``/v1/batches``, batches/runner.py) on a fake ChatService, without a
model: expiry ends a batch at the right time with the right status -- lines never run are
``batch_expired`` in its error file, a batch whose last line finished after ``expires_at`` is
completed, a batch that expires before it started has every line ``batch_expired`` in its error
file, written off the loop (or fails as validation does, its file invalid); a shutdown while its
expiry is written fails it and leaves no file behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mm_pipeline.server.batches import runner as batch_runner
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.errors import APIError
from tests.support.batches import FakeService, create_body, finished, line, rows, until, upload


# ---- 7-9. expiry ---------------------------------------------------------------------------------
def test_lines_never_run_because_the_batch_expired_are_error_lines(store):
    async def main():
        runner = BatchRunner(None, store, 1)

        async def expire(text):  # the window closes while the first line is answered
            runner.get(batch_id).expires_at = int(time.time()) - 1

        runner.service = FakeService(expire)
        batch_id = runner.create(create_body(upload(store, [line(f"l{i}") for i in range(4)]))).id
        return runner.service, await finished(runner, batch_id)

    svc, batch = asyncio.run(main())
    assert batch.status == "expired" and svc.started == ["l0"]
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 1, "failed": 3}
    assert [(r["custom_id"], r["error"]["code"]) for r in rows(store, batch.error_file_id)] == [
        ("l1", "batch_expired"), ("l2", "batch_expired"), ("l3", "batch_expired")]


def test_a_batch_whose_last_line_finished_after_expires_at_is_completed(store):
    async def main():
        runner = BatchRunner(None, store, 2)

        async def expire(text):
            runner.get(batch_id).expires_at = int(time.time()) - 1

        runner.service = FakeService(expire)
        batch_id = runner.create(create_body(upload(store, [line("only")]))).id
        return await finished(runner, batch_id)

    batch = asyncio.run(main())
    assert batch.status == "completed" and batch.error_file_id is None and batch.request_counts.completed == 1


def test_a_batch_expired_while_waiting_has_each_line_batch_expired_written_off_the_loop(store, monkeypatch):
    threads, read = [], batch_runner.read_lines

    def noted(path, max_bytes):  # the expiry's pass over the file (validation.py reads its own)
        threads.append(threading.get_ident())
        yield from read(path, max_bytes)

    monkeypatch.setattr(batch_runner, "read_lines", noted)

    async def main():
        release = asyncio.Event()

        async def hold(text):
            await release.wait()

        svc = FakeService(hold)
        runner = BatchRunner(svc, store, 1)
        running = runner.create(create_body(upload(store, [line("run")])))
        late = runner.create(create_body(upload(store, [line(f"l{i}") for i in range(3)])))
        await until(lambda: running.status == "in_progress")
        late.expires_at = int(time.time()) - 1  # noticed by a client, while the worker is busy
        assert runner.get(late.id).status == "finalizing"
        with pytest.raises(APIError) as refused:
            runner.cancel(late.id)
        ended = await finished(runner, late.id)
        assert running.status == "in_progress"  # expired without the worker
        release.set()
        await finished(runner, running.id)
        return svc, ended, refused.value, threading.get_ident()

    svc, batch, refused, loop_thread = asyncio.run(main())
    assert refused.status == 409 and svc.started == ["run"]
    assert batch.status == "expired" and batch.expired_at and batch.in_progress_at is None
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert batch.output_file_id is None
    assert [(r["custom_id"], r["response"], r["error"]["code"]) for r in rows(store, batch.error_file_id)] == [
        ("l0", None, "batch_expired"), ("l1", None, "batch_expired"), ("l2", None, "batch_expired")]
    assert len(threads) == 2 and loop_thread not in threads  # the running batch's pass and the expiry's


def test_a_batch_expired_while_validated_by_the_worker_has_each_line_batch_expired(store, monkeypatch):
    validate, validated = batch_runner.validate_file, []

    async def main():
        runner = BatchRunner(FakeService(), store, 1)

        def slow(path, endpoint, limits):  # the window closes while the file is validated
            validated.append(path)
            runner._batches[batch_id].expires_at = int(time.time()) - 1
            return validate(path, endpoint, limits)

        monkeypatch.setattr(batch_runner, "validate_file", slow)
        batch_id = runner.create(create_body(upload(store, [line("a"), line("b")]))).id
        return runner.service, await finished(runner, batch_id)

    svc, batch = asyncio.run(main())
    assert batch.status == "expired" and svc.started == [] and len(validated) == 1  # not validated again
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}
    assert [(r["custom_id"], r["error"]["code"]) for r in rows(store, batch.error_file_id)] == [
        ("a", "batch_expired"), ("b", "batch_expired")]


def test_a_batch_expired_before_it_started_with_an_invalid_file_fails_as_validation_does(store):
    async def main():
        runner = BatchRunner(FakeService(), store, 1)
        bad = runner.create(create_body(upload(store, [line("a"), "not json", line("a")])))
        bad.expires_at = int(time.time()) - 1
        return await finished(runner, bad.id)

    batch = asyncio.run(main())
    assert batch.status == "failed" and batch.expired_at is None and batch.error_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json"), (3, "duplicate_custom_id")]
    assert [f.purpose for f in store.list()] == ["batch"]


def test_a_shutdown_fails_a_batch_whose_expiry_is_being_written_and_leaves_no_file(store, monkeypatch):
    reading, go = threading.Event(), threading.Event()
    read = batch_runner.read_lines

    def held(path, max_bytes):
        reading.set()
        go.wait(10)
        yield from read(path, max_bytes)

    monkeypatch.setattr(batch_runner, "read_lines", held)

    async def main():
        runner = BatchRunner(FakeService(), store, 1)
        late = runner.create(create_body(upload(store, [line("a"), line("b")])))
        late.expires_at = int(time.time()) - 1
        runner.get(late.id)
        await until(reading.is_set)
        await runner.close()
        go.set()  # the thread the expiry left behind writes into a discarded file: nothing is kept
        return late

    batch = asyncio.run(main())
    assert batch.status == "failed" and batch.errors.data[0].code == "server_shutdown"
    assert batch.error_file_id is None and [f.purpose for f in store.list()] == ["batch"]
    store.check_integrity()
