"""Run a function on a fresh thread at a given intra-op thread count: how the C kernels' wide-thread
paths (a long step's rows split among the engine thread's OpenMP team) are compared with one thread."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads

T = TypeVar("T")


def on_threads(n: int, fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh thread whose own intra-op count is ``n`` (OpenMP and MKL, that thread only);
    an exception it raises is raised here."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        set_local_threads(n)
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            err.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
