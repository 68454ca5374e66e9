"""A request head (request line and headers) is bounded before anything reads it: httptools holds a
header of any size, so a client without a key grew the server by 150 MB per connection. Past the
bound the connection is answered 431 and closed, naming a request id (the log line names the same);
ordinary heads (a few KB of cookies) and pipelined requests pass. uvicorn on 127.0.0.1 in a thread,
raw sockets, with httptools' protocol (the server's) and with h11's (where httptools is missing)."""

from __future__ import annotations

import logging
import re
import socket

import httpx
import pytest
from fastapi import FastAPI

from mm_pipeline.server.launch.http_protocol import MAX_HEAD_BYTES, protocol_kwargs
from mm_pipeline.server.launch.runner import ServerThread
from mm_pipeline.server.request_id import RequestIdHeader


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request):
    if request.param == "httptools":
        pytest.importorskip("httptools")
    app = FastAPI()
    app.add_middleware(RequestIdHeader)  # as the server's app: every answer the app makes names its request

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    with ServerThread(app, protocol=protocol_kwargs(use_h11=request.param == "h11")) as s:
        yield s


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def uvicorn_log():
    """uvicorn's error log (uvicorn sends it to its own handler, not to the root's)."""
    handler, logger = Lines(), logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _raw(server: ServerThread, head: bytes, chunk: int = 16 << 10) -> bytes:
    """Send ``head`` in ``chunk``-byte writes (stopping when the server closes) and read the answer."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        try:
            for i in range(0, len(head), chunk):
                sock.sendall(head[i:i + chunk])
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server once over the bound
        got = b""
        try:
            while data := sock.recv(65536):
                got += data
        except ConnectionResetError:
            pass
        return got


def test_a_head_over_the_bound_is_a_431_and_closed(server, uvicorn_log):
    ids = []
    for named in (b"", b"X-Request-Id: trace-1\r\n"):  # a client's id, even one read whole, is not echoed
        got = _raw(server, b"GET /ping HTTP/1.1\r\nHost: x\r\n" + named + b"X-Big: " + b"a" * (4 * MAX_HEAD_BYTES))
        assert got.startswith(b"HTTP/1.1 431 "), got[:200]
        head, _, body = got.partition(b"\r\n\r\n")
        assert b"request_header_fields_too_large" in body
        ids += re.findall(rb"\r\nx-request-id: ([0-9a-f]{32})\r\n", head, re.IGNORECASE)
    assert len(ids) == len(set(ids)) == 2, ids
    refused = [line for line in uvicorn_log if "answered 431" in line]
    assert [line.split(": ", 1)[0] for line in refused] == [i.decode() for i in ids], uvicorn_log
    r = httpx.get(server.base_url + "/ping", headers={"X-Request-Id": "after"})  # the server goes on
    assert r.json() == {"ok": True} and r.headers["X-Request-Id"] == "after"


def test_ordinary_and_pipelined_heads_pass(server):
    r = httpx.get(server.base_url + "/ping", headers={"Cookie": "c=" + "x" * 16_000, "X-Other": "y" * 8000})
    assert r.status_code == 200
    one = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (MAX_HEAD_BYTES // 4) + b"\r\n\r\n"
    got = _raw(server, one * 6 + b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", chunk=40_000)
    assert got.count(b"HTTP/1.1 200 ") == 7, got[:300]
