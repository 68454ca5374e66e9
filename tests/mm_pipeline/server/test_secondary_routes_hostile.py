"""What a hostile or careless client met on the secondary routes (batches, files, Responses, any
body), each answered by name without internals: a batch's input file cannot vanish under it, a
failed batch names no server path or class, a batch line's 400 names what the route's would, a
Responses input cannot repeat an item id (its input_items pages by id), and a body that stops
arriving is a 408 instead of a connection held for good."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from mm_pipeline.server import ServerSettings, create_app
from mm_pipeline.server.batches import runner as batch_runner
from mm_pipeline.server.batches.failure import fail_batch
from mm_pipeline.server.batches.lines import parse_line
from mm_pipeline.server.batches.protocol import BatchObject
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FilesStore
from mm_pipeline.server.files.uploads import receive_upload
from mm_pipeline.server.json_limits import JSONLimits
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.request_body import parse_body
from tests.mm_pipeline.server.test_error_statuses import ScriptedEngine
from tests.support.batches import FakeService, create_body, finished, line, until, upload


# ---- batches: the input file, a failure's words, a line's 400 ------------------------------------
def test_a_batch_input_cannot_be_deleted_until_its_batch_ends(store):
    """Deleted between the batch's validation and its reading, the input failed the batch with
    ``FileNotFoundError: ... '/tmp/mmserve-files-.../blobs/...'`` in its error (and a traceback)."""
    async def main():
        service = FakeService()
        gate = asyncio.Event()
        service.hook = lambda text: gate.wait()
        runner = batch_runner.BatchRunner(service, store, 1)
        file_id = upload(store, [line("a"), line("b")])
        batch = runner.create(create_body(file_id))
        assert runner.reading(file_id) == batch.id
        await until(lambda: batch.status == "in_progress")
        assert runner.reading(file_id) == batch.id
        gate.set()
        assert (await finished(runner, batch.id)).status == "completed" and runner.reading(file_id) is None
    asyncio.run(main())


def test_the_files_route_refuses_to_delete_a_waiting_batchs_input(tmp_path, monkeypatch):
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))), raise_server_exceptions=False) as c:
        body = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n"
        file_id = c.post("/v1/files", files={"file": ("in.jsonl", body.encode())}, data={"purpose": "batch"}).json()["id"]
        monkeypatch.setattr(batch_runner.BatchRunner, "_work", lambda self: asyncio.sleep(3600))  # it waits
        batch = c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()
        r = c.delete(f"/v1/files/{file_id}")
        assert r.status_code == 409 and batch["id"] in r.json()["error"]["message"]
        assert c.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        assert c.delete(f"/v1/files/{file_id}").status_code == 200  # ended: its input may go


@pytest.mark.parametrize("exc,says,hides", [
    (FileNotFoundError(2, "No such file or directory", "/tmp/mmserve-files-x/blobs/abc"),
     "the input file file-1 was deleted before the batch read it", "/tmp/"),
    (OSError(28, "No space left on device", "/srv/files/out.jsonl"), "No space left on device", "/srv/"),
    (KeyError("internal_state"), "logged as batch", "KeyError"),
])
def test_a_failed_batch_names_what_happened_not_the_servers_internals(exc, says, hides):
    batch = BatchObject(id="batch_x", endpoint="/v1/chat/completions", input_file_id="file-1")
    fail_batch(batch, exc)
    message = batch.errors.data[0].message
    assert batch.status == "failed" and says in message and hides not in message


def test_a_batch_created_as_its_input_is_deleted_fails_naming_that_without_a_traceback(store, caplog):
    """The files route's 409 comes before its delete thread runs; a create landing while that
    thread deletes (the store's delete done here directly) found the record, and the batch failed
    as "an internal error" with a traceback logged."""
    async def main():
        runner = batch_runner.BatchRunner(FakeService(), store, 1)
        file_id = upload(store, [line("a")])
        batch = runner.create(create_body(file_id))
        store.delete(file_id)  # before the worker's first turn
        return await finished(runner, batch.id)

    with caplog.at_level("INFO", logger="mm_pipeline.server.batches.runner"):
        batch = asyncio.run(main())
    assert batch.status == "failed" and "was deleted before the batch read it" in batch.errors.data[0].message
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]


def test_a_batch_lines_400_names_the_problem_as_the_route_does(tmp_path):
    """The line took pydantic's first error (a union branch's: ``prompt.str: Input should be a valid
    string``) where the route names the deepest (``prompt.0.0: ... 2147483647``)."""
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": [[10 ** 12]], "max_tokens": 1}})
    answered = parse_line(1, raw).problem
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))), raise_server_exceptions=False) as c:
        route = c.post("/v1/completions", json={"model": "m", "prompt": [[10 ** 12]], "max_tokens": 1})
    assert route.status_code == 400 and answered[0] == 400
    assert answered[2] == route.json()["error"]["message"]
    assert answered[2].startswith("prompt.0.0: ") and "2147483647" in answered[2]


# ---- Responses: item ids ------------------------------------------------------------------------
def test_a_responses_input_may_not_repeat_an_item_id(tmp_path):
    """GET .../input_items pages by item id: with a repeated one, ``after=<it>`` went back to its
    first copy forever (the SDK's iterator listed 51 items of 3 before it was stopped)."""
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))), raise_server_exceptions=False) as c:
        r = c.post("/v1/responses", json={"model": "m", "input": [
            {"id": "dup", "role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"id": "dup", "role": "user", "content": "c"}]})
        empty = c.post("/v1/responses", json={"model": "scripted", "input": [  # an empty id is given a fresh one
            {"id": "", "role": "user", "content": "a"}, {"id": "", "role": "user", "content": "b"}]})
    assert r.status_code == 400
    assert "item 2 repeats the id 'dup' of item 0" in r.json()["error"]["message"]
    assert empty.status_code == 200


# ---- any body: one that stops arriving ----------------------------------------------------------
class Stalling:
    """A request whose body sends one piece and then nothing (the client declared more)."""

    def __init__(self, first: bytes, content_type: str = "application/json") -> None:
        self.first, self.headers = first, {"content-type": content_type, "content-length": "100000"}

    async def stream(self):
        yield self.first
        await asyncio.sleep(3600)
        yield b""


def test_a_json_body_that_stalls_is_a_408():
    with pytest.raises(APIError) as info:
        asyncio.run(asyncio.wait_for(parse_body(Stalling(b'{"messages": ['), ChatCompletionRequest,
                                                JSONLimits(1 << 20, 1 << 20), idle_s=0.2), 10))
    assert info.value.status == 408 and "stalled" in info.value.message


def test_an_upload_that_stalls_is_a_408_and_leaves_no_file(tmp_path):
    store = FilesStore(tmp_path / "files")
    request = Stalling(b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\nabc",
                       "multipart/form-data; boundary=XX")
    with pytest.raises(APIError) as info:
        asyncio.run(asyncio.wait_for(receive_upload(request, store, idle_s=0.2), 10))
    assert info.value.status == 408
    assert store.list(None) == [] and not any(p.is_file() for p in (tmp_path / "files").rglob("*"))


def test_deleting_a_response_while_it_streams_keeps_it_out_of_the_store(tmp_path):
    """Its id is in the stream's first event; a DELETE then answered 404 and the response was
    stored anyway when the stream ended."""
    import threading

    import httpx

    from mm_pipeline.server import ServerThread
    from tests.mm_pipeline.server.test_error_statuses import GenerationDelta

    gate = threading.Event()

    class Gated(ScriptedEngine):
        async def _script(self, rid):
            yield GenerationDelta(rid, [7], "a", None, None, False, None, 3, 1, 0, 0.0)
            await asyncio.to_thread(gate.wait, 30)
            yield GenerationDelta(rid, [], "", None, None, True, "length", 3, 1, 0, 0.0)

    app = create_app(Gated(), ServerSettings(files_dir=str(tmp_path)))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json={"model": "scripted", "input": "hi", "stream": True}) as r:
            lines = r.iter_lines()
            first = next(json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: "))
            rid = first["response"]["id"]
            gone = c.delete(f"/v1/responses/{rid}")
            assert gone.status_code == 200 and gone.json()["deleted"] is True
            gate.set()
            rest = list(lines)
            assert any("response.incomplete" in ln or "response.completed" in ln for ln in rest), rest
        assert c.get(f"/v1/responses/{rid}").status_code == 404
        kept = c.post("/v1/responses", json={"model": "scripted", "input": "hi"}).json()  # others are kept
        assert c.get(f"/v1/responses/{kept['id']}").status_code == 200


def test_the_served_app_answers_a_stalled_body_408_after_the_setting(tmp_path):
    """Through uvicorn (``request_body_idle_s``, ``--request-body-idle-s``): a client that declared
    1,000 bytes and sent 10 gets a 408 and its connection closed."""
    import socket
    import time

    from mm_pipeline.server import ServerThread

    app = create_app(ScriptedEngine(), ServerSettings(files_dir=str(tmp_path), request_body_idle_s=0.5))
    with ServerThread(app) as served:
        host, port = served.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"messages\"")
            t0, answer = time.monotonic(), b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"stalled" in answer
        assert b"connection: close" in answer.lower()  # closed at once, not after keep-alive's 5 s
        assert time.monotonic() - t0 < 15


# ---- uploads: the file part and its name ----------------------------------------------------------
def test_an_upload_names_no_control_characters_and_an_empty_filename_is_still_the_file(tmp_path):
    """A filename kept a bidi override and control characters (echoed in every file object); the
    part named 'file' with an empty filename (httpx's ("", data)) was read as a plain field and
    refused as "too long"."""
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))), raise_server_exceptions=False) as c:
        name = "\u202e\x01gpj.jsonl\x7f".encode()  # raw in the header (httpx would percent-encode it)
        body = (b"--XX\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nuser_data\r\n"
                b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name + b"\"\r\n\r\n"
                + b"x" * 5000 + b"\r\n--XX--\r\n")
        r = c.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=XX"})
        assert r.status_code == 200 and r.json()["filename"] == "gpj.jsonl"
        r = c.post("/v1/files", files={"file": ("", b"y" * 5000)}, data={"purpose": "user_data"})
        assert r.status_code == 200 and r.json()["filename"] == "upload" and r.json()["bytes"] == 5000


def test_a_delete_while_a_big_answer_is_sized_for_the_store_keeps_it_out(tmp_path, monkeypatch):
    """The stream's last event comes before the response is stored, and a big entry is sized on a
    thread: a DELETE in that window answered "deleted" and the response was stored anyway."""
    import threading

    import httpx

    from mm_pipeline.server import ServerThread
    from mm_pipeline.server.responses_api import routes

    sizing, release = threading.Event(), threading.Event()
    sized = routes._sized_entry

    def slow(*args, **kwargs):
        sizing.set()
        release.wait(30)
        return sized(*args, **kwargs)

    monkeypatch.setattr(routes, "_sized_entry", slow)
    long_input = [{"role": "user", "content": f"m{i}"} for i in range(300)]  # sized on a thread
    app = create_app(ScriptedEngine(), ServerSettings(files_dir=str(tmp_path)))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json={"model": "scripted", "input": long_input, "stream": True}) as r:
            lines = r.iter_lines()
            rid = next(json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: "))["response"]["id"]
            assert sizing.wait(30)
            assert c.delete(f"/v1/responses/{rid}").json()["deleted"] is True
            release.set()
            list(lines)
        assert c.get(f"/v1/responses/{rid}").status_code == 404
        assert c.delete(f"/v1/responses/{rid}").status_code == 404  # a second DELETE finds nothing


def test_a_filename_keeps_the_joiners_words_are_spelled_with_and_loses_line_separators():
    from mm_pipeline.server.files.files_store import _clean_name

    assert _clean_name("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645.txt") == "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645.txt"
    assert _clean_name("a\u2028b\u2029c.txt") == "abc.txt"
    assert _clean_name("dir/\u202egpj.exe") == "gpj.exe"
