"""Paged decode attention on CPU, one layer: the C kernel reading K/V in place from the pages
(``kernels/native/paged_decode.c``) vs the torch path (key grid gathered from the pool + ATen's flash
kernel, ``kernels/cpu/paged_attention.py``), side by side in one run, same plan inputs.

Shapes: the ``text_throughput.py`` model (8 / 2 heads (full), 8 / 4 (sliding), head dims 32 / 32,
window 64, context 144 = prompt 128 + 16) and MiMo-V2.5 (``kv_capacity.py``'s config: full attention
64 / 4 heads, sliding 64 / 8, head dims 192 / 128, window 128; context 4,096). Pages of 16 tokens
scattered at random over the pool (as a busy pool hands them out); the plan is built once outside
the timing (the engine builds it once per step for all layers). CPU time of this thread, medians of
``--repeats`` rounds, the two paths alternating; the outputs are compared (max abs difference).
``--cold``: the caches are emptied before every timed call, as in a decode step, where the weights
streamed since the layer before have evicted the K/V; warm (default) the pool of a small case stays
in the caches between calls.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import time

import torch
from _common import base_parser, print_table, write_json

from kernels.native import build as native_build
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu

PAGE = 16
# name -> (heads, kv heads, q/k dim, v dim, window or None, context)
SHAPES = {
    "bench_full": (8, 2, 32, 32, None, 144),
    "bench_swa": (8, 4, 32, 32, 64, 144),
    "mimo_full_4k": (64, 4, 192, 128, None, 4096),
    "mimo_swa": (64, 8, 192, 128, 128, 4096),
}


def case(batch: int, heads: int, kv_heads: int, dqk: int, dv: int, window: int | None, context: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages_per = -(-context // PAGE)
    num_pages = batch * pages_per + 1
    perm = torch.randperm(num_pages, generator=g)[: batch * pages_per]
    table = perm.view(batch, pages_per).clone()
    if window is not None:  # pages wholly behind the window are released, as the engine does
        table[:, : max(0, context - window) // PAGE] = -1
    k = torch.randn(num_pages * PAGE, kv_heads, dqk, generator=g)
    v = torch.randn(num_pages * PAGE, kv_heads, dv, generator=g)
    q = torch.randn(batch, heads, dqk, generator=g)
    lens = torch.full((batch,), context)
    qsl = torch.arange(batch + 1)
    return q, k, v, table, qsl, lens


def plan_for(native: bool, table, qsl, lens, window):
    native_build.set_enabled(native)
    try:
        return AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=window)
    finally:
        native_build.set_enabled(True)


def cpu_ms(fn, calls: int, evict: torch.Tensor | None) -> float:
    """CPU ms per call; with ``evict``, each call is timed alone after writing that buffer (the
    caches then hold no K/V, as in a decode step where each layer's weights streamed through)."""
    if evict is None:
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t0) * 1e3 / calls
    spent = 0.0
    for _ in range(calls):
        evict.add_(1.0)
        t0 = time.thread_time()
        fn()
        spent += time.thread_time() - t0
    return spent * 1e3 / calls


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--cold", action="store_true", help="evict the caches (write 64 MB) before each timed call")
    args = p.parse_args()
    evict = torch.ones(16 << 20) if args.cold else None
    torch.set_num_threads(1)
    batches = [1, 32] if args.quick else [int(b) for b in args.batches.split(",")]
    repeats = 3 if args.quick else args.repeats
    rows, out = [], {}
    for name in args.shapes.split(","):
        heads, kv_heads, dqk, dv, window, context = SHAPES[name]
        for b in batches:
            q, k, v, table, qsl, lens = case(b, heads, kv_heads, dqk, dv, window, context)
            kw = dict(page_size=PAGE, scale=dqk**-0.5, window=window, sinks=torch.randn(heads) if window else None)
            plans = {m: plan_for(m, table, qsl, lens, window) for m in (False, True)}
            if plans[True].native is None:
                raise SystemExit("the C kernel is not available here (no compiler, or MMSERVE_NATIVE_KERNELS=0)")
            run = {m: (lambda m=m: paged_attention_cpu(q, k, v, table, qsl, lens, plan=plans[m], **kw)) for m in plans}
            diff = (run[True]() - run[False]()).abs().max().item()
            kv_bytes = b * min(context, window or context) * kv_heads * (dqk + dv) * 4
            calls = max(3, int(2e7 // max(kv_bytes, 1)))  # ~20 MB of K/V per timing
            times = {False: [], True: []}
            for _ in range(repeats):
                for m in (False, True):
                    times[m].append(cpu_ms(run[m], calls, evict))
            torch_ms, c_ms = (statistics.median(times[m]) for m in (False, True))
            rows.append([name, b, window or "-", context, f"{kv_bytes / 1e6:.2f}", torch_ms, c_ms, torch_ms / c_ms,
                         kv_bytes / (c_ms * 1e-3) / 1e9, f"{diff:.1e}"])
            out.update({f"{name}_b{b}_torch_ms": torch_ms, f"{name}_b{b}_native_ms": c_ms,
                        f"{name}_b{b}_speedup": torch_ms / c_ms, f"{name}_b{b}_max_abs_diff": diff})
    cold = ", caches emptied before each call" if args.cold else ""
    print_table(f"paged decode attention, one layer, CPU ms (medians, 1 thread{cold})",
                ["shape", "batch", "window", "context", "K/V MB read", "torch (gather + flash)", "C in place",
                 "speed-up", "C GB/s of K/V", "max |diff|"], rows)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
