"""Intra-op thread counts per thread, without touching any other thread's (CPU).

``torch.set_num_threads(n)`` sets the calling thread's OpenMP team size and MKL count, and also
stores ``n`` process-wide: every thread that has not run a parallel op yet takes that value (for
OpenMP and MKL) at its first one. When the engine thread widened a long step to its team that way,
a thread starting its first op meanwhile -- a KV tier writer, the encoder cache's writer, a fresh
worker -- took the wide count and started a team of its own, which then stays for that thread's
life; with two teams on two CPUs libgomp parks idle team threads and every op of every step pays a
wake-up (thread_choice.py).

So a thread that chooses its own count sets only its own: OpenMP's per-thread ``nthreads`` (what
torch's parallel ops and oneDNN read) and MKL's thread-local count (``MKL_Set_Num_Threads_Local``).
The process-wide value is set once, to one thread, when the engine thread owns the one wide team
(``set_process_default``). Both libraries are found among the objects torch itself loaded
(``/proc/self/maps``); where one is missing (a torch without MKL, not Linux) the call falls back to
``torch.set_num_threads``.

Verified on the 2-core host (torch 2.11, MKL 2024.2): a thread at a local 2 ran a 1000^2 GEMM in 12
vs 22 ms at 1, and a thread starting meanwhile ran at the process-wide 1 (tests/.../test_intra_op.py
shows both, and the leak with torch.set_num_threads).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kernels.native.build import loaded_library

_lock = threading.Lock()
_libs: tuple[ctypes.CDLL | None, ctypes.CDLL | None] | None = None


def _libraries() -> tuple[ctypes.CDLL | None, ctypes.CDLL | None]:
    """(libgomp with omp_set_num_threads, the library exporting MKL_Set_Num_Threads_Local), as loaded."""
    global _libs
    with _lock:
        if _libs is None:
            omp = mkl = None
            gomp_path, torch_path = loaded_library("libgomp"), loaded_library("libtorch_cpu")
            try:
                omp = ctypes.CDLL(gomp_path) if gomp_path else None
                if omp is not None and not hasattr(omp, "omp_set_num_threads"):
                    omp = None
                mkl = ctypes.CDLL(torch_path) if torch_path else None
                if mkl is not None and not hasattr(mkl, "MKL_Set_Num_Threads_Local"):
                    mkl = None
            except OSError:
                omp = mkl = None
            _libs = (omp, mkl)
        return _libs


def set_local_threads(n: int) -> None:
    """This thread's intra-op count ``n`` (OpenMP team size and MKL's thread-local count), leaving
    the process-wide default and every other thread's count as they are."""
    if n < 1:
        raise ValueError(f"intra-op threads must be >= 1, got {n}")
    torch.get_num_threads()  # torch's once-per-thread init first: it would reset the count set below
    omp, mkl = _libraries()
    if omp is None:
        torch.set_num_threads(n)
        return
    omp.omp_set_num_threads(ctypes.c_int(n))
    if mkl is not None:
        mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(n))


def set_process_default(n: int) -> None:
    """The count threads that never set one run at: torch's process-wide value and MKL's global
    count (``torch.set_num_threads`` sets both); also the calling thread's."""
    torch.set_num_threads(n)
