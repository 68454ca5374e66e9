"""``mmserve serve`` in a child process on 127.0.0.1 (tests and benchmarks of the real command line:
its defaults, its start-up lines, its resident memory).

    with ServerProcess(["--model", "samples/demo-model"]) as server:
        httpx.get(server.base_url + "/health"); server.rss_bytes(); server.startup
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

from mm_pipeline.server.launch.runner import free_port


class ServerProcess:
    """``python -m mm_pipeline.cli serve ARGS --port P``; ``start`` returns once ``/health`` answers
    (or raises with the process's output), ``stop`` interrupts it and waits (bounded)."""

    def __init__(self, args: Sequence[str], start_timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 verify: str | bool = True) -> None:
        """``verify``: how the readiness check trusts an HTTPS server (``--ssl-certfile`` in ``args``):
        a CA bundle or certificate path (a self-signed test certificate), as httpx takes it."""
        self.port = free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        # a path as an SSL context: httpx deprecated verify=<path>
        self.verify = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        self.scheme = "https" if "--ssl-certfile" in self.args else "http"
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, **(env or {})}
        # output goes to a file, not a pipe: a chatty server never blocks on a full pipe
        self._log = tempfile.NamedTemporaryFile("w+", prefix="mmserve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        """Everything the server printed so far (start-up lines, logs)."""
        return Path(self._log.name).read_text()

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "mm_pipeline.cli", "serve", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mmserve serve did not come up on {self.base_url}:\n{self.output}")
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        """Resident memory of the server process now (Linux /proc)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line in /proc/PID/status")

    def stop(self) -> int | None:
        """SIGINT, then SIGKILL after 30 s; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self._log.name)
