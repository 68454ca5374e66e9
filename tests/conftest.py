"""Shared fixtures.  ``redis_server``: a throwaway Redis on a free loopback port (no persistence),
one per test session; tests that need it skip when ``redis-server`` is not installed."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(autouse=True)
def native_kernels_switch_restored() -> Iterator[None]:
    """Every test leaves the C kernels' process-wide switch as it found it: an engine built with
    ``native_cpu_kernels=False`` turns it off for the whole process (as it must, see LLMEngine), and a
    later test on the same xdist worker would otherwise find the kernels off."""
    from kernels import native

    before = native.enabled()
    yield
    native.set_enabled(before)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for modules of tiny-model tests: a second thread only adds sync cost on
    tiny matmuls, and on a shared 2-core box it makes them ~30x slower. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def running_redis(workdir: Path, *extra: str) -> Iterator[int]:
    """A redis-server of the test's own on 127.0.0.1 (``extra``: more server options); its port."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port} (exit code {proc.poll()})")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Port of a running redis-server bound to 127.0.0.1."""
    with running_redis(tmp_path_factory.mktemp("redis")) as port:
        yield port


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """One local Ray cluster per test session (``num_cpus=2``, no dashboard), shared by the Ray Data
    and Ray Serve tests because ``ray.init`` is process-wide; shut down at the end."""
    pytest.importorskip("ray")
    from mm_pipeline.cluster.ray_runtime import RayClusterConfig, connect, shutdown

    ray = connect(RayClusterConfig(num_cpus=2))
    try:
        yield ray
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - Serve may never have started
            pass
        shutdown()


# ---- pytest-xdist (`make test` runs two workers with --dist loadgroup) ---------------------------------
def _group_for_workers(items: list[pytest.Item]) -> None:
    """One xdist group per test file, so a file's module fixtures (checkpoints, servers) are built
    once, on one worker; every file that uses the session's Ray cluster joins one "ray" group, so
    the suite starts one local cluster (num_cpus=2), not one per worker. Without xdist the mark is
    inert."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for path, file_items in files.items():
        group = "ray" if any("ray_local" in getattr(i, "fixturenames", ()) for i in file_items) else path
        for item in file_items:
            item.add_marker(pytest.mark.xdist_group(group))


# ---- Triton kernel tests: deselect, rather than skip, the side this process does not run ----------
KERNEL_MARKERS = {
    "triton_kernel": "a Triton kernel test: runs in place on CUDA, else only in the TRITON_INTERPRET=1 child "
                     "(see tests/kernels/test_kernels_support.py)",
    "interpreter_rerun": "re-runs its test file in a TRITON_INTERPRET=1 child pytest (CPU parent only)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in KERNEL_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Kernel tests run either here or in the interpreter child, never both: the other side is
    deselected, so a CPU run reports no skips for tests the child ran (and a child failure still
    fails the parent's ``test_under_interpreter``). Every test is grouped for pytest-xdist first."""
    _group_for_workers(items)
    if not any(item.get_closest_marker(name) for item in items for name in KERNEL_MARKERS):
        return
    from tests.kernels.test_kernels_support import RUNS_HERE  # imports torch: only when kernel tests were collected

    drop = "interpreter_rerun" if RUNS_HERE else "triton_kernel"
    keep = [item for item in items if not item.get_closest_marker(drop)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(drop)])
        items[:] = keep
