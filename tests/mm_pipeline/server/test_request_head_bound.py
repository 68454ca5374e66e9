"""A request head (request line and headers) is bounded before anything reads it: httptools holds a
header of any size, so a client without a key grew the server by 150 MB per connection. Past the
bound the connection is answered 431 and closed; ordinary heads (a few KB of cookies) and pipelined
requests pass. uvicorn on 127.0.0.1 in a thread, raw sockets."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi import FastAPI

from mm_pipeline.server.launch.http_protocol import MAX_HEAD_BYTES
from mm_pipeline.server.launch.runner import ServerThread


@pytest.fixture(scope="module")
def server():
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    with ServerThread(app) as s:
        yield s


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


def test_a_head_over_the_bound_is_a_431_and_closed(server):
    got = _raw(server, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 * MAX_HEAD_BYTES))  # never ends
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert b"request_header_fields_too_large" in got
    assert httpx.get(server.base_url + "/ping").json() == {"ok": True}  # the server goes on


def test_ordinary_and_pipelined_heads_pass(server):
    r = httpx.get(server.base_url + "/ping", headers={"Cookie": "c=" + "x" * 16_000, "X-Other": "y" * 8000})
    assert r.status_code == 200
    one = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (MAX_HEAD_BYTES // 4) + b"\r\n\r\n"
    got = _raw(server, one * 6 + b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", chunk=40_000)
    assert got.count(b"HTTP/1.1 200 ") == 7, got[:300]
