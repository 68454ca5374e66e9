"""A drain (SIGTERM, SIGINT) and the work a server runs with no HTTP request open: background
responses and ``/v1/batches`` (background_drain.py). A new background response or batch reaching
the server once the drain began is a 503, as the engine's refusal is; the work taken runs on through
the grace period, and what still runs then ends in a terminal state naming the shutdown -- a
background response ``failed``, a batch ``cancelled`` with its answered lines kept in the file store
(on disk: they outlive the process) -- and the process exits a few seconds after the grace period.

In process (``DrainingServer`` in a thread over a scripted engine: the recorded states) and as
``mmserve serve`` in a child process (SIGTERM; what is left on disk; the exit)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server import ServerSettings, create_app, free_port
from mm_pipeline.server.files.files_store import FilesStore
from mm_pipeline.server.launch.http_protocol import protocol_kwargs
from mm_pipeline.server.launch.runner import DrainingServer
from mm_pipeline.server.launch.server_process import ServerProcess
from tests.mm_pipeline.server.test_reasoning_server import ThinkingEngine
from tests.mm_pipeline.server.test_responses_background import SlowEngine
from tests.support.paths import DEMO_MODEL
from tests.support.responses_api import message_text

GRACE_S = 2.0
EXIT_BOUND_S = 5.0  # the process exits this soon after the grace period (closing, the engine shut down)


class _Words(ThinkingEngine):
    """Answers ``max_tokens`` words: each request says how long it runs."""

    async def generate(self, messages: Any, params: Any, *, request_id: str = "r-0", priority: int = 0,
                       cache_salt: str | None = None):
        ids = self.encoder.encode("word ", add_special_tokens=False)
        for k in range(params.max_tokens):
            last = k == params.max_tokens - 1
            yield GenerationDelta(request_id, ids, "word ", None, None, last, "stop" if last else None,
                                  len(self.prompt_ids), (k + 1) * len(ids), 0, time.time(),
                                  prompt_token_ids=list(self.prompt_ids) if k == 0 else None)


class WordsEngine(SlowEngine, _Words):
    """SlowEngine (a word every ``delay`` s, its open generations counted) answering ``max_tokens`` words."""


def batch_line(cid: str, words: int, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Talk."}], "max_tokens": words, **body}}


def start_batch(base: str, lines: list[dict]) -> tuple[str, str]:
    """(input file id, batch id) of a batch of ``lines``, once its first line is answered."""
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    r = httpx.post(base + "/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"}, timeout=30)
    file_id = r.json()["id"]
    batch_id = create_batch(base, file_id)
    until(lambda: httpx.get(f"{base}/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 1)
    return file_id, batch_id


def create_batch(base: str, file_id: str) -> str:
    r = httpx.post(base + "/v1/batches", json=batch_body(file_id), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def batch_body(file_id: str) -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def start_background(base: str, **fields) -> str:
    r = httpx.post(base + "/v1/responses", json={"input": "Talk.", "background": True, **fields}, timeout=30)
    assert r.status_code == 200, r.text
    until(lambda: httpx.get(f"{base}/v1/responses/{r.json()['id']}").json()["status"] == "in_progress")
    return r.json()["id"]


def until(holds, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline
        time.sleep(0.02)


class HeldPosts:
    """POSTs whose body is held after its first byte until ``send``: requests the server took before
    its drain began and reads to their end after (the listener closed meanwhile)."""

    def __init__(self, base: str, posts: list[tuple[str, dict]]) -> None:
        self.go = threading.Event()
        self.answers: dict[str, httpx.Response] = {}
        in_flight = self._in_flight(base)
        self._threads = [threading.Thread(target=self._post, args=(base + path, body)) for path, body in posts]
        for thread in self._threads:
            thread.start()
        until(lambda: self._in_flight(base) == in_flight + len(posts))  # the server has their heads

    @staticmethod
    def _in_flight(base: str) -> int:
        metrics = httpx.get(base + "/metrics", timeout=30).text
        return int(float(next(x.split()[1] for x in metrics.splitlines()
                              if x.startswith("mmserve_http_requests_in_flight "))))

    def _post(self, url: str, body: dict) -> None:
        data = json.dumps(body).encode()

        def content():
            yield data[:1]
            self.go.wait(60)
            yield data[1:]

        self.answers[url.rsplit("/", 1)[1]] = httpx.post(url, content=content(), timeout=60,
                                                         headers={"content-type": "application/json"})

    def send_once_draining(self, port: int) -> None:
        """Once the listener refuses connections (the drain began), send the rest of the bodies."""
        until(lambda: not _accepts(port), timeout_s=10)
        self.go.set()
        for thread in self._threads:
            thread.join(30)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def assert_refused_while_draining(answers: dict[str, httpx.Response]) -> None:
    for route, r in answers.items():
        assert r.status_code == 503, (route, r.text)
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
        assert r.headers["Retry-After"] == "1"


def test_a_drain_lets_background_work_finish_in_its_grace_period_and_ends_the_rest(tmp_path):
    engine = WordsEngine([], delay=0.01)  # 100 words a second
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path)))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **protocol_kwargs())
    server = DrainingServer(config, GRACE_S, end_requests=lambda: 0, drain=app.state.drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started)
    base = f"http://127.0.0.1:{port}"
    try:
        file_id, batch_id = start_batch(base, [batch_line("short", 3)] + [batch_line(f"long{i}", 10**5)
                                                                          for i in range(3)])
        waiting = create_batch(base, file_id)  # batches run one after another: it waits
        long = start_background(base, max_output_tokens=10**5)  # ~1,000 s
        held = HeldPosts(base, [("/v1/responses", {"input": "Hi", "background": True}),
                                ("/v1/batches", batch_body(file_id))])
        short = start_background(base, max_output_tokens=50)  # ~0.5 s: ends inside the grace period
        began = time.monotonic()
        server.should_exit = True
        held.send_once_draining(port)
        thread.join(GRACE_S + EXIT_BOUND_S + 5)
        took = time.monotonic() - began
    finally:
        server.should_exit = server.force_exit = True
        thread.join(30)
    assert not thread.is_alive() and took < GRACE_S + EXIT_BOUND_S, took
    assert_refused_while_draining(held.answers)

    stored = {rid: app.state.responses.get(rid).response for rid in (short, long)}
    assert stored[short].status == "completed" and message_text(stored[short].model_dump()) == "word " * 50
    assert stored[long].status == "failed" and stored[long].error.code == "server_error"
    assert "shut down" in stored[long].error.message

    batch = app.state.batches.get(batch_id)
    assert batch.status == "cancelled" and batch.errors.data[0].code == "server_shutdown", batch
    assert batch.request_counts.completed == 1 and batch.output_file_id is not None
    kept = app.state.store.path(batch.output_file_id).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in kept] == ["short"]
    never_ran = app.state.batches.get(waiting)
    assert never_ran.status == "cancelled" and never_ran.errors.data[0].code == "server_shutdown", never_ran
    assert never_ran.output_file_id is None and never_ran.request_counts.total == 0
    assert len(app.state.batches.list(100, None).data) == 2  # the batch sent while draining was never made
    assert engine.in_flight == 0 and len(engine.aborted) == 4  # the long response and the 3 long lines


@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
def test_sigterm_refuses_new_background_work_keeps_a_batchs_answered_lines_and_exits_in_time(tmp_path):
    files = tmp_path / "files"
    # lines one at a time: 4 of 1,900 tokens (seconds each on CPU) cannot all end in the grace period
    server = ServerProcess(["--model", str(DEMO_MODEL), "--device", "cpu", "--shutdown-timeout-s", str(GRACE_S),
                            "--files-dir", str(files), "--batch-concurrency", "1"]).start()
    try:
        base = server.base_url
        file_id, _ = start_batch(base, [batch_line("short", 2)] + [batch_line(f"long{i}", 1900, ignore_eos=True)
                                                                   for i in range(4)])
        start_background(base, max_output_tokens=1900, ignore_eos=True)
        held = HeldPosts(base, [("/v1/responses", {"input": "Hi", "background": True}),
                                ("/v1/batches", batch_body(file_id))])
        server.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        held.send_once_draining(server.port)
        assert server.proc.wait(timeout=GRACE_S + EXIT_BOUND_S + 20) == 0, server.output
        took = time.monotonic() - began
    finally:
        server.stop()
    assert took < GRACE_S + EXIT_BOUND_S, (took, server.output)
    assert_refused_while_draining(held.answers)
    assert "Traceback" not in server.output, server.output
    # the shut-down batch's answered line is in the file store, on disk: a restarted server serves it
    outputs = FilesStore(files).list("batch_output")
    assert len(outputs) == 1 and outputs[0].filename.endswith("_output.jsonl"), outputs
    kept = [json.loads(x) for x in FilesStore(files).path(outputs[0].id).read_text().splitlines()]
    assert kept[0]["custom_id"] == "short" and len(kept) < 5  # (a long line may have ended in the grace period)
    assert all(x["response"]["status_code"] == 200 for x in kept)
