"""The C layer glue of a decode step vs the torch ops it replaces, one layer's calls at a time.

The calls of a layer (kernels/native/decoder_layer.c, kernels/native/moe_experts.c):

* **front**: input RMSNorm -> QKV projection -> RoPE -> value scale -> K/V stored at the rows' slots
  (torch: ``rms_norm``, ``linear``, the rotary's flip / mul / add, two ``index_copy_``);
* **out**: o_proj -> residual add -> post-attention RMSNorm (torch: ``linear``, add, ``rms_norm``);
* **MLP** (layer 0 of the demo model): gate / up -> SiLU * up -> down -> residual add (torch: three
  ``linear``, ``silu``, mul, add);
* **MoE**: router GEMM -> sigmoid / bias / top-k / renormalise -> experts (torch: the router's ops
  then the same C experts kernel, i.e. what ``main`` ran before the router moved into C);
* **LM head** (greedy): the head's GEMM with a running argmax per row (kernels/native/greedy_head.c;
  torch: ``linear`` then ``argmax``), over 4 heads of 8 MB cycled; the difference column counts the
  rows whose ids differ.

Rows = decode requests of the step. Shapes: the ``text_throughput.py`` demo model. The calls cycle over
``--layers`` layers' weights (more bytes than the last-level cache, so they come from memory as in a
real step), torch and C alternating, CPU time of this thread, medians of ``--repeats``; the values
are compared (max abs difference).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import time

import torch
from _common import base_parser, print_table, write_json
from torch.nn import functional as F

from kernels import ops
from kernels.cpu.moe import kernel_layout
from kernels.native import decoder_layer, greedy_head, moe_experts
from llm_core.model.layers.rope import PartialRotary

H, HQ, HKV, D, ROT, E, I, TOP_K = 256, 8, 2, 32, 10, 16, 128, 2
N = (HQ + 2 * HKV) * D
VOCAB = 8192


def layer_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"qkv": ops.linear_weight_layout(torch.randn(N, H, generator=gen) * H**-0.5),
            "o": ops.linear_weight_layout(torch.randn(H, HQ * D, generator=gen) * H**-0.5),
            "norm1": torch.rand(H, generator=gen) + 0.5, "norm2": torch.rand(H, generator=gen) + 0.5,
            "mlp_gate": ops.linear_weight_layout(torch.randn(2 * H, H, generator=gen) * H**-0.5),
            "mlp_up": ops.linear_weight_layout(torch.randn(2 * H, H, generator=gen) * H**-0.5),
            "mlp_down": ops.linear_weight_layout(torch.randn(H, 2 * H, generator=gen) * (2 * H)**-0.5),
            "gate": torch.randn(E, H, generator=gen) * H**-0.5, "bias": torch.randn(E, generator=gen) * 0.1,
            "gate_up": kernel_layout(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5),
            "down": kernel_layout(torch.randn(E, H, I, generator=gen) * I**-0.5)}


def front_torch(x, w, step):
    qkv = F.linear(F.rms_norm(x, (H,), w["norm1"], 1e-6), w["qkv"])
    t = x.shape[0]
    qk = qkv[:, : (HQ + HKV) * D].view(t, HQ + HKV, D)
    step["rotary"].apply_(qk, step["cos"], step["sin"])
    ops.store_kv(step["k"], step["v"], step["slots"], qk[:, HQ:], qkv[:, (HQ + HKV) * D :].view(t, HKV, D),
                 all_valid=True)
    return qkv


def front_c(x, w, step):
    return decoder_layer.attention_front(x, w["norm1"], 1e-6, w["qkv"], num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                         v_head_dim=D, cos=step["cos"], signed_sin=step["sin"], value_scale=1.0,
                                         k_cache=step["k"], v_cache=step["v"], slots=step["slots"])


def out_torch(x, w, step):
    y = x + F.linear(step["attn"], w["o"])
    return torch.cat([y, F.rms_norm(y, (H,), w["norm2"], 1e-6)])


def out_c(x, w, step):
    return torch.cat(decoder_layer.attention_out(step["attn"], w["o"], x, w["norm2"], 1e-6))


def mlp_torch(x, w, step):
    return x + F.linear(F.silu(F.linear(x, w["mlp_gate"])) * F.linear(x, w["mlp_up"]), w["mlp_down"])


def mlp_c(x, w, step):
    return decoder_layer.dense_mlp(x, w["mlp_gate"], w["mlp_up"], w["mlp_down"], x)


def moe_torch(x, w, step):
    weights, ids = ops.route(F.linear(x, w["gate"]), w["bias"], top_k=TOP_K)
    return moe_experts.moe_experts(x, w["gate_up"], w["down"], weights, ids)


def moe_c(x, w, step):
    return moe_experts.moe_route_experts(x, w["gate"], w["bias"], w["gate_up"], w["down"], top_k=TOP_K)


def head_torch(x, w, step):
    return F.linear(x, w["head"]).argmax(-1)


def head_c(x, w, step):
    return torch.tensor(greedy_head.lm_head_argmax(x, w["head"]))


def case(part: str, fns, rows: int, layers: list[dict], repeats: int, gen: torch.Generator) -> dict:
    x = torch.randn(rows, H, generator=gen)
    cos, sin = PartialRotary(ROT, 10_000.0).tables(torch.randint(0, 4000, (rows,), generator=gen), torch.float32)
    step = {"rotary": PartialRotary(ROT, 10_000.0), "cos": cos, "sin": sin, "k": torch.zeros(4096, HKV, D),
            "v": torch.zeros(4096, HKV, D), "slots": torch.randperm(4096, generator=gen)[:rows],
            "attn": torch.randn(rows, HQ * D, generator=gen)}
    times: dict[str, list[float]] = {"torch": [], "C": []}
    outs = {}
    for _ in range(repeats):
        for label, fn in zip(("torch", "C"), fns):
            t0 = time.thread_time()
            for w in layers:
                outs[label] = fn(x, w, step)
            times[label].append((time.thread_time() - t0) / len(layers) * 1e6)
    torch_us, c_us = statistics.median(times["torch"]), statistics.median(times["C"])
    return {"part": part, "rows": rows, "torch_us": torch_us, "c_us": c_us, "speedup": torch_us / c_us,
            "max_abs_diff": float((outs["torch"] - outs["C"]).abs().max())}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=40, help="layers' weights cycled (~8.5 MB each: from memory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not (decoder_layer.available() and moe_experts.available()):
        print("the C kernels are off or could not be built here (needs a C compiler); nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    layers = [layer_weights(gen) for _ in range(12 if args.quick else args.layers)]
    repeats = 3 if args.quick else args.repeats
    parts = {"front": (front_torch, front_c), "out": (out_torch, out_c), "MLP": (mlp_torch, mlp_c),
             "MoE": (moe_torch, moe_c)}
    results = [case(part, fns, rows, layers, repeats, gen) for part, fns in parts.items()
               for rows in ((1, 32) if args.quick else (1, 8, 32, 64))]
    if greedy_head.available():  # from 2 rows (one row stays on MKL's GEMV); 9+ rows ask for it only on
        # AVX-512 builds (greedy_head.pays), shown everywhere
        heads = [{"head": ops.linear_weight_layout(torch.randn(VOCAB, H, generator=gen) * H**-0.5)} for _ in range(4)]
        results += [case("LM head", (head_torch, head_c), rows, heads, repeats, gen)
                    for rows in ((8, 32) if args.quick else (2, 8, 32, 64)) if rows <= greedy_head.MAX_ROWS]
    columns = list(results[0])
    print_table(f"one layer's glue, CPU us per call (median of {repeats}, 1 thread, {len(layers)} layers' "
                "weights cycled)", columns, [[r[c] for c in columns] for r in results])
    write_json(args.json, {f"{r['part']}_r{r['rows']}_{k}": v for r in results for k, v in r.items()
                           if k not in ("part", "rows")})


if __name__ == "__main__":
    main()
