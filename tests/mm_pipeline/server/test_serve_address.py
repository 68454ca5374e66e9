"""Where ``mmserve serve`` listens: the socket is bound before the model loads (a port in use, an
empty or unresolvable --host are usage errors naming the flag, before any weight is read), and the
start-up line names the address actually bound (--port 0: the port the system chose)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.support.paths import DEMO_MODEL

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")

SERVE = [sys.executable, "-m", "mm_pipeline.cli", "serve", "--model", str(DEMO_MODEL), "--device", "cpu"]


@pytest.fixture()
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, flag", [
    (None, "--port"),  # the busy port
    (["--host", ""], "--host"),
    (["--host", "no-such-host.invalid"], "--host"),
])
def test_where_it_cannot_listen_is_a_usage_error_before_the_model_loads(argv, flag, busy_port):
    argv = ["--host", "127.0.0.1", "--port", str(busy_port)] if argv is None else argv
    proc = subprocess.run([*SERVE, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr, proc.stderr  # refused before the model loads


def test_port_0_prints_the_port_bound():
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen([*SERVE, "--port", "0"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", Path(log.name).read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
                time.sleep(0.2)
            port = int(m.group(1))
            assert port != 0
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0


def test_a_port_bound_by_a_server_still_loading_is_refused_to_a_second():
    """Two servers started side by side: the first holds the port while its model loads (its socket
    listens at once), so the second's bind fails before it loads anything. With SO_REUSEADDR and no
    listen() both binds succeeded, and the second failed only inside uvicorn, after loading."""
    from mm_pipeline.server.launch.listen import Listen

    first, bound = Listen(host="127.0.0.1", port=0).bind()
    try:
        with pytest.raises(ValueError, match=f"--port {bound.port} / --host 127.0.0.1: cannot listen there"):
            Listen(host="127.0.0.1", port=bound.port).bind()
    finally:
        first.close()
