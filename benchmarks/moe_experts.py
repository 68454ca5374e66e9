"""One MoE layer's experts on CPU: the C kernel (kernels/native/moe_experts.c) vs the torch paths.

For each row count (tokens of a step; each picks top-k experts) both run the same call of
:func:`kernels.moe_cpu.experts_cpu`'s contract, alternating, CPU time of this thread (one intra-op
thread), medians of ``--repeats``. Weights come from memory as in a real step: the calls cycle over
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

from kernels import moe_cpu, native
from kernels.moe_cpu import experts_cpu
from kernels.moe_ref import route_ref
from kernels.native.moe_experts import available, moe_experts


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


def case(name, tokens, hidden, inter, num_experts, top_k, layers, repeats, gen) -> dict:
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
    return {"shape": name, "tokens": tokens, "rows_per_expert": tokens * top_k / num_experts, "torch_ms": torch_ms,
            "c_ms": c_ms, "speedup": torch_ms / c_ms, "c_gb_s": gbytes / (c_ms / 1e3),
            "max_abs_diff": float((outs["torch"] - outs["C"]).abs().max()) if tokens else 0.0}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=8, help="demo-model layers cycled (weights from memory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not available():
        print("the C kernels are off or could not be built here (needs a C compiler); nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    demo_tokens = (1, 4, 32, 128) if args.quick else (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512)
    mimo_tokens = (1,) if args.quick else (1, 2, 4)
    repeats = 3 if args.quick else args.repeats
    results = [case("demo", t, 256, 128, 16, 2, args.layers, repeats, gen) for t in demo_tokens]
    results += [case("MiMo-V2.5", t, 4096, 2048, 256, 8, 1, max(3, repeats // 2), gen) for t in mimo_tokens]
    columns = list(results[0])
    print_table(f"one MoE layer's experts, CPU ms per call (median of {repeats}, 1 thread); "
                f"C kernel serves up to {moe_cpu.NATIVE_ROWS_PER_EXPERT} rows per expert in experts_cpu",
                columns, [[r[c] for c in columns] for r in results])
    flat = {}
    for r in results:
        tag = f"{'mimo' if r['shape'] != 'demo' else 'demo'}_t{r['tokens']}"
        flat.update({f"{tag}_{k}": v for k, v in r.items() if k not in ("shape", "tokens")})
    write_json(args.json, flat)


if __name__ == "__main__":
    main()
