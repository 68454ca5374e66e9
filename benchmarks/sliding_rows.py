"""Sliding-layer prefill attention: the flash band (query blocks over their own keys) vs every row as a
C decode row, per window and head shape -- the measurement behind ``NATIVE_ANY_ROWS_WINDOW`` in
kernels/cpu/attention_plan.py.

    .venv/bin/python benchmarks/sliding_rows.py            # the table (+ --json PATH)
    .venv/bin/python benchmarks/sliding_rows.py --quick    # without the MiMo-V2.5-size row

Each row: one request's chunk of n rows after ``ctx`` earlier tokens, the step's plan built once and
four sliding layers attending with it (what a prefill step of the pipeline benchmark's model does),
one intra-op thread, CPU time (``time.thread_time``), the best of the repetitions. Both paths run in
the same process, interleaved; ``max_diff`` is the largest difference of their outputs (fp32 rounding).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import time

import torch

import kernels.cpu.attention_plan as pac
from _common import base_parser, print_table, write_json
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu

PAGE = 16
# (n, ctx, window, q heads, kv heads, q/k dim, v dim): the pipeline benchmark's model (8 / 8 heads of
# 24 / 16, W = 8), the demo model's sliding layers (4 / 2 of 32, W = 32), a question after a cache hit
SHAPES = [(376, 0, 8, 8, 8, 24, 16), (376, 0, 8, 4, 2, 32, 32), (120, 300, 8, 4, 2, 32, 32),
          (376, 0, 32, 8, 8, 24, 16), (376, 0, 32, 4, 2, 32, 32), (120, 300, 32, 4, 2, 32, 32),
          (376, 0, 128, 8, 8, 24, 16), (376, 0, 128, 4, 2, 32, 32), (120, 300, 128, 4, 2, 32, 32)]
MIMO = (2048, 0, 128, 64, 8, 192, 128)  # MiMo-V2.5's sliding layers, one 2048-token chunk


def measure(n: int, ctx: int, window: int, hq: int, hkv: int, d: int, dv: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    length = ctx + n
    pages = -(-length // PAGE)
    k_cache, v_cache = torch.randn(pages * PAGE, hkv, d, generator=g), torch.randn(pages * PAGE, hkv, dv, generator=g)
    table = torch.arange(pages).view(1, -1)
    qsl, lens = torch.tensor([0, n]), torch.tensor([length])
    q, sinks = torch.randn(n, hq, d, generator=g), torch.randn(hq, generator=g)
    k_new, v_new = k_cache[ctx:length], v_cache[ctx:length]  # pages in order: slot == position

    def step() -> torch.Tensor:
        plan = AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=window)
        for _ in range(4):
            out = paged_attention_cpu(q, k_cache, v_cache, table, qsl, lens, page_size=PAGE, scale=d**-0.5,
                                      window=window, sinks=sinks, plan=plan, k_new=k_new, v_new=v_new)
        return out

    limits = {"band": (1, 0), "c_rows": (n, n + window)}  # (NATIVE_SHORT_ROWS_SLIDING, NATIVE_ANY_ROWS_WINDOW)
    best = {name: float("inf") for name in limits}
    outs = {}
    saved = pac.NATIVE_SHORT_ROWS_SLIDING, pac.NATIVE_ANY_ROWS_WINDOW
    try:
        for r in range(reps + 1):  # the first round warms up
            for name, (rows, win) in limits.items():
                pac.NATIVE_SHORT_ROWS_SLIDING, pac.NATIVE_ANY_ROWS_WINDOW = rows, win
                t0 = time.thread_time()
                outs[name] = step()
                if r:
                    best[name] = min(best[name], time.thread_time() - t0)
    finally:
        pac.NATIVE_SHORT_ROWS_SLIDING, pac.NATIVE_ANY_ROWS_WINDOW = saved
    return {"band_ms": 1e3 * best["band"], "c_rows_ms": 1e3 * best["c_rows"],
            "max_diff": float((outs["band"] - outs["c_rows"]).abs().max())}


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    rows, results = [], {}
    for shape in SHAPES + ([] if args.quick else [MIMO]):
        n, ctx, window, hq, hkv, d, dv = shape
        got = measure(*shape, reps=3 if shape is MIMO else (10 if args.quick else 30))
        key = f"n{n}_ctx{ctx}_w{window}_h{hq}x{hkv}_d{d}"
        results.update({f"{key}_{k}": v for k, v in got.items()})
        rows.append([n, ctx, window, f"{hq}/{hkv} x {d}/{dv}", got["band_ms"], got["c_rows_ms"],
                     got["band_ms"] / got["c_rows_ms"], got["max_diff"]])
    print_table("sliding prefill attention, plan + 4 layers, CPU ms (1 thread, best of the repetitions)",
                ["rows", "earlier", "window", "heads q/kv x dim q/v", "flash band", "C rows", "band / C", "max diff"],
                rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
