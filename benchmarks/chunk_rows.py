"""A request's run of query rows over its keys -- a question after a prefix-cache hit, a prompt's chunk
-- three ways: ATen's flash kernel (the band on a sliding layer), the C kernel's single rows (each row
walks its keys), and the C kernel's chunk path (paged_decode.c attend_chunk: each block of keys
transposed once for every row's queries). The measurement behind ``NATIVE_CHUNK_HEAD_DIM``,
``NATIVE_CHUNK_ROWS`` and ``NATIVE_CHUNK_KEYS`` in kernels/cpu/attention_plan.py.

    .venv/bin/python benchmarks/chunk_rows.py            # the table (+ --json PATH)
    .venv/bin/python benchmarks/chunk_rows.py --quick    # without the MiMo-V2.5-size rows

Each row: one request's chunk of n rows after ``ctx`` earlier tokens (pages scattered), the plan built
and one layer's attention, wall ms per call at one intra-op thread and at two (the call splits its
rows on a wide thread's team), medians of the repetitions, the three ways interleaved in one process.
``max_diff``: the largest difference of the chunk path's output from flash's (fp32 rounding).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import contextlib
import statistics
import time

import torch

import kernels.cpu.attention_plan as pac
from _common import base_parser, fresh_thread, print_table, write_json
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads

PAGE = 16
# (n, ctx, window, q heads, kv heads, q/k dim, v dim): the pipeline benchmark's model (full layers 8 / 4
# heads of 24 / 16; its same-prefix step is the first row), the demo model's heads (4 / 2 of 32), larger
# heads, sliding layers at W = 8, 32, 128
SHAPES = [(29, 1088, None, 8, 4, 24, 16), (16, 1088, None, 8, 4, 24, 16), (64, 1088, None, 8, 4, 24, 16),
          (376, 0, None, 8, 4, 24, 16), (512, 0, None, 8, 4, 24, 16), (512, 2048, None, 8, 4, 24, 16),
          (256, 4096, None, 4, 2, 32, 32), (29, 1088, None, 4, 2, 32, 32), (29, 1088, None, 8, 4, 64, 64),
          (29, 1088, None, 16, 4, 64, 64), (29, 1088, None, 8, 4, 128, 128),
          (376, 0, 8, 8, 8, 24, 16), (376, 0, 32, 4, 2, 32, 32), (120, 300, 32, 4, 2, 32, 32),
          (27, 393, 128, 8, 8, 24, 16), (64, 393, 128, 4, 2, 32, 32)]
MIMO = [(29, 2000, None, 64, 4, 192, 128), (64, 2000, None, 64, 4, 192, 128), (512, 0, None, 64, 4, 192, 128),
        (64, 2000, 128, 64, 8, 192, 128)]  # MiMo-V2.5's layers


@contextlib.contextmanager
def way(name: str, n: int, d: int):
    """The plan's limits set so that the request goes ``name``'s way."""
    names = ("NATIVE_SHORT_ROWS", "NATIVE_SHORT_ROWS_SLIDING", "NATIVE_ANY_ROWS_WINDOW", "NATIVE_CHUNK_ROWS",
             "NATIVE_CHUNK_HEAD_DIM")
    saved = {k: getattr(pac, k) for k in names}
    setting = {"flash": (1, 1, 0, 1, 0), "c_rows": (n, n, 1 << 30, n, 0), "chunk": (8, n, 0, n, d)}[name]
    try:
        for k, v in zip(names, setting):
            setattr(pac, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(pac, k, v)


def measure(n, ctx, window, hq, hkv, d, dv, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    length = ctx + n
    pages = -(-length // PAGE)
    k_cache, v_cache = torch.randn(2 * pages * PAGE, hkv, d, generator=g), torch.randn(2 * pages * PAGE, hkv, dv, generator=g)
    table = torch.randperm(2 * pages, generator=g)[:pages].view(1, -1)
    qsl, lens = torch.tensor([0, n]), torch.tensor([length])
    q, sinks = torch.randn(n, hq, d, generator=g), torch.randn(hq, generator=g)

    def call(name: str):
        with way(name, n, d):
            plan = AttentionPlan.build(table, qsl, lens, page_size=PAGE, window=window, head_dim=d)
        return paged_attention_cpu(q, k_cache, v_cache, table, qsl, lens, page_size=PAGE, scale=d**-0.5,
                                   window=window, sinks=sinks, plan=plan)

    out: dict[str, float] = {}
    for threads in (1, 2):
        times: dict[str, list[float]] = {name: [] for name in ("flash", "c_rows", "chunk")}

        def rounds():
            set_local_threads(threads)  # this thread's OpenMP and MKL count only
            for r in range(reps + 1):  # the first round warms up
                for name in times:
                    t0 = time.perf_counter()
                    call(name)
                    if r:
                        times[name].append(time.perf_counter() - t0)

        fresh_thread(rounds)
        out.update({f"{name}_{threads}t_ms": 1e3 * statistics.median(ts) for name, ts in times.items()})
    out["max_diff"] = float((call("chunk") - call("flash")).abs().max())
    return out


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    rows, results = [], {}
    for shape in SHAPES + ([] if args.quick else MIMO):
        n, ctx, window, hq, hkv, d, dv = shape
        got = measure(*shape, reps=3 if shape in MIMO else (15 if args.quick else 40))
        key = f"n{n}_ctx{ctx}_w{window}_h{hq}x{hkv}_d{d}"
        results.update({f"{key}_{k}": v for k, v in got.items()})
        rows.append([n, ctx, window or "-", f"{hq}/{hkv} x {d}/{dv}",
                     *(got[f"{w}_{t}t_ms"] for t in (1, 2) for w in ("flash", "c_rows", "chunk")), got["max_diff"]])
    print_table("a chunk's attention, plan + one layer, wall ms (medians; 1 thread | 2 threads)",
                ["rows", "earlier", "window", "heads q/kv x dim q/v", "flash 1t", "C rows 1t", "chunk 1t",
                 "flash 2t", "C rows 2t", "chunk 2t", "max diff"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
