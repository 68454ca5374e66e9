"""``silent_redis_url``: a "Redis" on a free loopback port that accepts connections and never answers
-- the slow Redis whose every call waits out the client's socket timeout. ``max_loop_lag``: how late
an event loop ran a 5 ms ticker while some work ran on it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest


@pytest.fixture
def silent_redis_url() -> Iterator[str]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.05)  # so the accepting thread sees the stop flag
    held: list[socket.socket] = []  # accepted and never read: every command times out
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:  # socket.timeout is one
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join(2.0)
        server.close()
        for conn in held:
            conn.close()


async def _max_loop_lag(work: Callable[[], Awaitable[None]]) -> float:
    """Run ``work()`` while a ticker measures how late the loop wakes it (every 5 ms), in seconds."""
    lag, done = 0.0, asyncio.Event()

    async def tick() -> None:
        nonlocal lag
        while not done.is_set():
            start = time.monotonic()
            await asyncio.sleep(0.005)
            lag = max(lag, time.monotonic() - start - 0.005)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)  # the ticker is running before the work starts
    try:
        await work()
    finally:
        done.set()
        await ticker
    return lag


@pytest.fixture
def max_loop_lag() -> Callable[[Callable[[], Awaitable[None]]], Awaitable[float]]:
    return _max_loop_lag
