"""What the runtime's threads run at, and how that was chosen: the counts the engine stats report
(``intra_op_threads``) and the line ``mmserve serve`` prints at start, e.g. "engine thread 2
(measured in 0.29 s: 1: 18.7 ms, 2: 13.1 ms) for steps of >= 256 rows (measured: 128 rows 1: 11.2
ms, 2: 12.0 ms) on free cores, 1 otherwise; encoder 1". Reads the engine loop's and the
encoder worker's thread settings (thread_choice.py) without changing them."""

from __future__ import annotations

from mm_pipeline.runtime.cpu_threads.thread_choice import ProbedThreads


def thread_counts(loop, worker) -> dict[str, int]:
    """The intra-op threads the engine thread (``loop``) and the encoder ``worker`` (or None) run
    at: those that set one."""
    counts = {}
    if loop.threads_used is not None:
        counts["engine"] = loop.threads_used
    if worker is not None and worker.threads_used is not None:
        counts["encoder"] = worker.threads_used
    elif worker is not None and isinstance(worker.threads, ProbedThreads) and worker.threads.choice is not None:
        counts["encoder"] = worker.threads.choice.threads  # chosen; the worker sets it right after
    return counts


def describe_threads(loop, worker, engine_cpu: bool) -> str:
    """The engine thread's (when it computes on the CPU: ``engine_cpu``) and the CPU encoder
    worker's intra-op threads and how each was chosen; "" when neither has a count of its own."""
    parts = []
    for name, threads in (("engine thread", loop.threads if engine_cpu else None),
                          ("encoder", worker.threads if worker is not None and worker.device.type == "cpu" else None)):
        if isinstance(threads, ProbedThreads) and threads.choice is not None:
            parts.append(f"{name} {threads.choice.describe()}")
        elif isinstance(threads, int):
            parts.append(f"{name} {threads}")
        elif callable(threads):
            parts.append(f"{name} follows the decode workers")
    steps = loop.step_threads
    if parts and parts[0].startswith("engine thread") and steps is not None and steps.wide > 1:
        how = steps.describe()
        parts[0] += f" for steps of >= {steps.min_rows} rows{f' ({how})' if how else ''} on free cores, 1 otherwise"
    if worker is not None and worker.lanes > 1:  # the encoder's share is divided among its lanes
        each = f" at {worker.threads_used} each" if worker.threads_used is not None else ""
        parts.append(f"{worker.lanes} encoder lanes{each}")
    return "; ".join(parts)
