"""Run the app under uvicorn in a background thread (tests, benchmarks, notebooks).

    with ServerThread(create_app(engine)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-")
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from types import FrameType
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI

from mm_pipeline.server.background_drain import BackgroundDrain
from mm_pipeline.server.launch.http_protocol import protocol_kwargs

log = logging.getLogger(__name__)
# After the grace period the handlers answer their aborted requests by themselves (milliseconds);
# uvicorn cancels whatever is left this much later, a last resort (a traceback and a bare 500 each)
ENDING_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` (a free port by default) in a daemon thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None,
                 start_timeout_s: float = 30.0, protocol: dict[str, Any] | None = None) -> None:
        """``protocol``: uvicorn's HTTP protocol keywords (None: the server's, ``protocol_kwargs()``)."""
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5, **(protocol or protocol_kwargs()))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="mmserve-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"uvicorn exited while starting on {self.base_url}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start on {self.base_url} in {self.start_timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGINT, SIGTERM) lets requests in flight finish for
    ``grace_s``, then ends the ones still running through ``end_requests`` (the engine aborts
    them; each handler answers its client as for any abort: a JSON 503, a stream's error event
    and [DONE]). uvicorn's own timeout would cancel the handlers' tasks instead: a bare plain-text
    500 or a stream cut without [DONE], and a CancelledError traceback per request in the log.
    ``drain``: the app's work with no request open (background responses, batches), told when the
    drain begins and hurried by a second Ctrl-C; the app's lifespan ends it (background_drain.py)."""

    def __init__(self, config: uvicorn.Config, grace_s: float, end_requests: Callable[[], int],
                 drain: BackgroundDrain | None = None) -> None:
        config.timeout_graceful_shutdown = grace_s + ENDING_S  # the backstop only
        super().__init__(config)
        self.grace_s = grace_s
        self.end_requests = end_requests
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit and self.drain is not None:  # a second Ctrl-C: the background work is not waited for
            self.drain.hurry()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain is not None:  # before the listener closes: a background submission from now on is a 503
            self.drain.begin(self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._end_requests)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()
            if self.force_exit:  # a second Ctrl-C: uvicorn stops waiting; what still runs is ended now
                self._end_requests()

    def _end_requests(self) -> None:
        ended = self.end_requests()
        if ended:
            log.warning("shutdown: %d engine request(s) still running after %g s aborted (HTTP requests answered "
                        "503; background responses and batches end recorded as shut down)", ended, self.grace_s)
