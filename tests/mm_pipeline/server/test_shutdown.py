"""Stopping ``mmserve serve`` (a child process): SIGTERM drains as SIGINT does and exits 0 after the
engine shut down; a request still running when --shutdown-timeout-s ends is aborted by the server
(a stream gets an error event then [DONE]), with no traceback in the log."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from mm_pipeline.server.launch.server_process import ServerProcess
from tests.support.paths import DEMO_MODEL

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")

ARGS = ["--model", str(DEMO_MODEL), "--device", "cpu"]


def test_sigterm_on_an_idle_server_exits_0_quickly():
    server = ServerProcess(ARGS).start()
    try:
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert server.proc.wait(timeout=30) == 0, server.output
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()
    assert "Traceback" not in server.output, server.output


def test_sigterm_past_the_grace_period_ends_requests_cleanly():
    server = ServerProcess([*ARGS, "--shutdown-timeout-s", "1"]).start()
    body = {"model": DEMO_MODEL.name, "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 100_000, "ignore_eos": True}
    events: list[str] = []
    answers: list[httpx.Response] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()

    clients = [threading.Thread(target=stream),
               threading.Thread(target=lambda: answers.append(
                   httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)))]
    try:
        for client in clients:
            client.start()
        assert streaming.wait(60), server.output
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output
        for client in clients:
            client.join(10)
    finally:
        server.stop()
    assert not any(client.is_alive() for client in clients)
    assert answers[0].status_code == 503, answers[0].text
    assert answers[0].json()["error"]["type"] == "service_unavailable"
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable", error
    assert "Traceback" not in server.output, server.output
