"""One MoE layer's experts on CPU: the C kernel (kernels/native/moe_experts.c) vs the torch paths.

For each row count (tokens of a step; each picks top-k experts) both run the same call of
:func:`kernels.cpu.moe.experts_cpu`'s contract, alternating, CPU time of this thread (one intra-op
thread), medians of ``--repeats``. From 64 tokens the two also run on a thread at ``--threads``
intra-op threads (default: torch's count; the engine thread's team during a long step, where the C
kernel splits the experts' rows among the team and MKL splits each GEMM), wall time, medians. Weights come from memory as in a real step: the calls cycle over
``--layers`` layers' expert stacks (more bytes than the last-level cache), stored in the kernel layout
the model runner installs. "torch" is what ``experts_cpu`` runs with the C kernels off (one-token
matmuls, the dense small-batch path or grouped_mm).

Shapes: the ``text_throughput.py`` demo model (H 256, I 128, 16 experts, top-2) and MiMo-V2.5 (H 4096,
I 2048, 256 experts, top-8; fp32, only the chosen experts' pages are ever touched, ~96 MB each, so
the MiMo rows stay at a few tokens). The values of both are compared (max abs difference).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import time

import torch
from _common import base_parser, print_table, write_json

from kernels import native
from kernels.cpu import moe as moe_cpu
from kernels.cpu.moe import experts_cpu
from kernels.moe_ref import route_ref
from kernels.native.moe_experts import available, moe_experts
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads
from mm_pipeline.runtime.cpu_threads.thread_choice import run_on_thread


def stacks(num_experts: int, hidden: int, inter: int, used: set[int], gen: torch.Generator):
    """Kernel-layout stacks [E, 2I, H] / [E, H, I]; only the ``used`` experts are written (the other
    pages are never touched, so 256 MiMo-sized experts cost only what the chosen ones hold)."""
    gu = torch.empty(num_experts, hidden, 2 * inter).transpose(1, 2)
    dn = torch.empty(num_experts, inter, hidden).transpose(1, 2)
    for e in sorted(used):
        gu[e].copy_(torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5)
        dn[e].copy_(torch.randn(hidden, inter, generator=gen) * inter**-0.5)
    return gu, dn


def torch_path(*args):
    native.set_enabled(False)
    try:
        return experts_cpu(*args)
    finally:
        native.set_enabled(True)


def wide_ms(fns, args_per_layer, repeats, threads) -> dict[str, float]:
    """Wall ms per layer of each fn on a fresh thread at ``threads`` intra-op threads, alternating."""
    def run() -> dict[str, float]:
        set_local_threads(threads)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats + 1):  # the first round starts the team and is dropped
            for label, fn in fns.items():
                t0 = time.perf_counter()
                for args in args_per_layer:
                    fn(*args)
                times[label].append((time.perf_counter() - t0) / len(args_per_layer) * 1e3)
        return {k: statistics.median(v[1:]) for k, v in times.items()}
    return run_on_thread(run, "bench-wide")


def case(name, tokens, hidden, inter, num_experts, top_k, layers, repeats, gen, threads=1) -> dict:
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route_ref(torch.randn(tokens, num_experts, generator=gen), None, top_k=top_k)
    used = set(ids.reshape(-1).tolist())
    per_layer = [stacks(num_experts, hidden, inter, used, gen) for _ in range(layers)]
    fns = {"torch": torch_path, "C": moe_experts}
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs = {}
    for _ in range(repeats):
        for label, fn in fns.items():
            t0 = time.thread_time()
            for gu, dn in per_layer:
                outs[label] = fn(x, gu, dn, weights, ids)
            times[label].append((time.thread_time() - t0) / layers * 1e3)
    torch_ms, c_ms = statistics.median(times["torch"]), statistics.median(times["C"])
    gbytes = len(used) * 3 * hidden * inter * 4 / 1e9
    wide: dict[str, float | None] = {"torch": None, "C": None}  # not measured: "-" in the table, not in the JSON
    if threads > 1 and tokens >= 64:
        wide = wide_ms(fns, [(x, gu, dn, weights, ids) for gu, dn in per_layer], repeats, threads)
    return {"shape": name, "tokens": tokens, "rows_per_expert": tokens * top_k / num_experts, "torch_ms": torch_ms,
            "c_ms": c_ms, "speedup": torch_ms / c_ms, "c_gb_s": gbytes / (c_ms / 1e3),
            "torch_wide_ms": wide["torch"], "c_wide_ms": wide["C"], "wide_speedup": wide["torch"] / wide["C"] if wide["C"] else None,
            "max_abs_diff": float((outs["torch"] - outs["C"]).abs().max()) if tokens else 0.0}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=8, help="demo-model layers cycled (weights from memory)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of the wide columns (default: torch's)")
    args = p.parse_args()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    if not available():
        print("the C kernels are off or could not be built here (needs a C compiler); nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    demo_tokens = (1, 4, 32, 128, 376) if args.quick else (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 376, 512)
    mimo_tokens = (1,) if args.quick else (1, 2, 4)
    repeats = 3 if args.quick else args.repeats
    results = [case("demo", t, 256, 128, 16, 2, args.layers, repeats, gen, threads) for t in demo_tokens]
    results += [case("MiMo-V2.5", t, 4096, 2048, 256, 8, 1, max(3, repeats // 2), gen) for t in mimo_tokens]
    columns = list(results[0])
    print_table(f"one MoE layer's experts, CPU ms per call (median of {repeats}, 1 thread; *_wide_ms: wall at "
                f"{threads} threads); experts_cpu takes the C kernel up to {moe_cpu.NATIVE_MAX_BYTES >> 20} MiB "
                "of (token, expert) rows",
                columns, [["-" if r[c] is None else r[c] for c in columns] for r in results])
    flat = {}
    for r in results:
        tag = f"{'mimo' if r['shape'] != 'demo' else 'demo'}_t{r['tokens']}"
        flat.update({f"{tag}_{k}": v for k, v in r.items() if k not in ("shape", "tokens") and v is not None})
    write_json(args.json, flat)


if __name__ == "__main__":
    main()
