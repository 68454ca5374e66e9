"""The batch runner (``/v1/batches``, batches/runner.py) on a fake ChatService, without a model: a
line is held to the server's request limits and parsed once, off the event loop; what a batch keeps
is bounded (metadata, echoed values); a line the engine has no room for waits instead of failing;
cancel and expiry end a batch at the right time with the right status -- a batch that expires
before it started has every line ``batch_expired`` in its error file, written off the loop; a
failure names its cause and leaves no file behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from pydantic import ValidationError

from mm_pipeline.errors import OverloadedError, ServerBusy
from mm_pipeline.server.batches import lines as batch_lines
from mm_pipeline.server.batches import runner as batch_runner
from mm_pipeline.server.batches.lines import LineTooLong, read_lines
from mm_pipeline.server.batches.protocol import BatchCreate
from mm_pipeline.server.batches import validation
from mm_pipeline.server.batches.result_files import ResultFiles
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.batches.validation import validate_file
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FilesStore, UploadTooLarge, UploadWriter
from mm_pipeline.server.json_limits import JSONLimits

URL = "/v1/chat/completions"
LIMITS = JSONLimits(max_bytes=4096, max_values=1024)


class Answer:
    def __init__(self, text: str) -> None:
        self.id = f"chatcmpl-{text}"

    def model_dump(self) -> dict:
        return {"id": self.id, "choices": [{"message": {"role": "assistant", "content": "ok " * 40}}]}


class FakeService:
    """Answers a chat with its first message's text; ``hook(text)`` runs first (it may raise or wait)."""

    def __init__(self, hook=None) -> None:
        self.hook = hook
        self.started: list[str] = []

    async def chat(self, req) -> Answer:
        text = req.messages[0].content
        self.started.append(text)
        if self.hook is not None:
            await self.hook(text)
        return Answer(text)


def line(cid: str, url: str = URL, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": cid}], **extra}})


def upload(store: FilesStore, rows: list[str], purpose: str = "batch") -> str:
    return store.put_bytes(("\n".join(rows) + "\n").encode(), "in.jsonl", purpose).id


def create_body(file_id: str, **kw) -> BatchCreate:
    return BatchCreate(input_file_id=file_id, endpoint=URL, completion_window="24h", **kw)


async def until(predicate, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def finished(runner: BatchRunner, batch_id: str):
    await until(lambda: runner.get(batch_id).finished)
    return runner.get(batch_id)


def rows(store: FilesStore, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.path(file_id).read_text().splitlines()]


@pytest.fixture
def store(tmp_path) -> FilesStore:
    return FilesStore(tmp_path / "files")


# ---- 1. a line is a request: the same limits, one parse, off the loop --------------------------------
def test_a_line_over_the_request_limits_fails_validation_naming_it(store, tmp_path):
    numbers = line("many", junk=[1] * 1100)  # 3.4 KB: within the bytes, over the values
    long = line("long", junk="x" * 10_000)
    path = store.path(upload(store, [line("a"), long, line("b"), numbers]))
    total, errors = validate_file(path, URL, LIMITS)
    assert total == 4
    assert [(e.line, e.code) for e in errors] == [(2, "line_too_large"), (4, "too_many_json_values")]
    assert "line 2" in errors[0].message and "4096-byte limit (max_request_bytes)" in errors[0].message
    assert "line 4 holds up to" in errors[1].message and "(max_json_values)" in errors[1].message


def test_a_long_line_is_skipped_in_pieces_and_the_numbering_goes_on(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\r\n" + b"x" * 5000 + b"\n\n" + b"y" * 10 + b"\r\n" + b"z" * 11)
    assert list(read_lines(path, 10)) == [(1, "a\r\n"), (2, LineTooLong(10)), (4, "y" * 10 + "\r\n"),
                                          (5, LineTooLong(10))]


def test_each_line_is_parsed_once_to_validate_and_once_to_answer_off_the_loop(store, monkeypatch):
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(threading.get_ident()) or loads(s, *a, **k))

    async def main():
        runner = BatchRunner(FakeService(), store, 2, LIMITS)
        batch = await finished(runner, runner.create(create_body(upload(store, [line(f"r{i}") for i in range(5)]))).id)
        return batch, threading.get_ident()

    batch, loop_thread = asyncio.run(main())
    assert batch.status == "completed" and batch.request_counts.completed == 5
    assert len(parsed) == 10 and loop_thread not in parsed


# ---- 2. what a batch keeps is bounded ------------------------------------------------------------------
@pytest.mark.parametrize("metadata, named", [
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
    ({"k": {"nested": ["x"]}}, "must be a string"),
    ({f"k{i}": "v" for i in range(17)}, "16"),
])
def test_metadata_follows_openais_rules(metadata, named):
    with pytest.raises(ValidationError) as exc:
        create_body("file-x", metadata=metadata)
    (error,) = exc.value.errors()
    assert error["loc"] == ("metadata",) and named in str(error["msg"])
    assert "k" * 65 not in str(error["msg"])
    assert create_body("file-x", metadata={"k" * 64: "v" * 512}).metadata


def test_validation_errors_quote_a_line_briefly_and_are_bounded_in_number(store):
    huge = "u" * 100_000
    path = store.path(upload(store, [line(f"c{i}", url=huge) for i in range(150)]))
    _, errors = validate_file(path, URL, JSONLimits(1 << 20, 1 << 20))
    assert len(errors) == validation.MAX_ERRORS_SHOWN
    assert all(len(e.message) < 250 for e in errors) and "…" in errors[0].message

    cid = "d" * 100_000
    path = store.path(upload(store, [line(cid), line(cid)]))
    (dup,) = validate_file(path, URL, JSONLimits(1 << 20, 1 << 20))[1]
    assert dup.code == "duplicate_custom_id" and len(dup.message) < 250 and dup.message.count("d") < 110


def test_an_input_file_must_have_purpose_batch(store):
    async def main():
        BatchRunner(FakeService(), store, 1).create(create_body(upload(store, [line("a")], purpose="user_data")))

    with pytest.raises(APIError) as exc:
        asyncio.run(main())
    assert exc.value.status == 400 and exc.value.param == "input_file_id" and "'batch'" in exc.value.message


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


# ---- 7-9. failures and expiry ---------------------------------------------------------------------------
def test_a_failure_names_the_error_not_the_task_group(tmp_path):
    store = FilesStore(tmp_path, max_file_bytes=1500, max_total_bytes=1 << 20)

    async def main():
        runner = BatchRunner(FakeService(), store, 2)
        return await finished(runner, runner.create(create_body(upload(store, [line(f"c{i}") for i in range(8)]))).id)

    batch = asyncio.run(main())
    assert batch.status == "failed"
    assert batch.errors.data[0].message.startswith("UploadTooLarge: file is larger than the 1500-byte")


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


def test_the_echo_of_a_value_is_cut_with_an_ellipsis():
    assert batch_lines.echo("short") == "'short'"
    cut = batch_lines.echo("x" * 1000)
    assert len(cut) == batch_lines.ECHO_CHARS and cut.endswith("…")
