"""Shared benchmark plumbing: the common flags, an aligned text table, a flat --json dump, the
measured fp32 matmul peak that MFU figures divide by, and work on a short-lived thread."""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def base_parser(description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with ``--quick`` (finish in < 60 s) and ``--json PATH``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smaller run that finishes in under a minute")
    p.add_argument("--json", metavar="PATH", help="also write the results as one flat JSON object")
    return p


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:,.2f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print rows under a title with right-aligned, width-fitted columns."""
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """Write ``results`` (must be flat: str -> number/str/bool) plus host info to ``path``."""
    if not path:
        return
    for k, v in results.items():
        if isinstance(v, (dict, list, tuple)):
            raise ValueError(f"--json output must be flat; {k!r} is a {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"--json output {k!r} is not finite: {v}")
    out = dict(results, host_python=platform.python_version(), host_machine=platform.machine())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {path}")


def best_time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Best (wall seconds, process CPU seconds) over ``reps`` calls. CPU time (all our threads) is
    what other processes on a shared machine cannot inflate much; wall time is the usual rate."""
    wall = cpu = float("inf")
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def matmul_rate(reps: int) -> tuple[float, float]:
    """Best fp32 GEMM rate over a few large shapes: (GFLOP per wall s, GFLOP per CPU s)."""
    best_wall = best_cpu = 0.0
    for m, k, n in ((2048, 512, 2048), (1024, 1024, 1024), (4096, 512, 1536)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        wall, cpu = best_time(lambda: a @ b, reps)
        best_wall, best_cpu = max(best_wall, 2 * m * k * n / wall / 1e9), max(best_cpu, 2 * m * k * n / cpu / 1e9)
    return best_wall, best_cpu


def first_token_s(base_url: str, payload: dict[str, Any]) -> float:
    """Seconds from sending a streamed chat request to its first content token (client side).

    The client and the JSON body are made before the clock starts: a user's client is already up
    when it sends, and neither is the server's work. Inside the clock they cost ~30 ms of a
    ~0.6 s served TTFT (a new httpx client loads an SSL context, ~20 ms; dumping a 20 s 720p
    clip's 3.8 MB of base64, ~8 ms; README "pipeline")."""
    import httpx

    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=300) as client:
        t0 = time.perf_counter()
        with client.stream("POST", base_url + "/v1/chat/completions", content=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


THREADS = torch.get_num_threads()  # the process's count, read when the first benchmark module loads


def fresh_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` on a short-lived thread at the process's intra-op count: the OpenMP team
    its torch ops start ends with it, so the benchmark's main thread holds none -- as in `mmserve
    serve`, where the engine thread's team is the only one and spins (runtime/cpu_threads/thread_choice.py)."""
    from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads
    from mm_pipeline.runtime.cpu_threads.thread_choice import run_on_thread

    def call() -> Any:
        set_local_threads(THREADS)
        return fn(*args, **kw)
    return run_on_thread(call, "bench")


def new_engine(model_dir: Any, config: Any) -> Any:
    """An OmniEngine built and started on a short-lived thread at the process's intra-op count (it
    plans its threads from that count), the calling thread -- the one that runs the requests' event
    loop -- then at one, as `mmserve serve` runs its loop: the engine thread's team stays the only
    one in the process (runtime/cpu_threads/thread_choice.py)."""
    from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads
    from mm_pipeline.runtime.omni_engine import OmniEngine

    engine = fresh_thread(OmniEngine.from_pretrained, model_dir, config)
    set_local_threads(1)
    return engine
