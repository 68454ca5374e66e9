"""Memory plan on paper: per-GPU bytes of MiMo-V2.5 at tensor- / expert-parallel choices on 8 GPUs of
141 GB (H200; ``--gpu-gb 80`` for H100s), and how many 128K-context requests each choice can hold at once.

No weights are read. Each rank's model is built on the ``meta`` device with its ParallelContext
(llm_core/distributed/), so the shapes are exactly what that rank would load; the KV geometry per rank
is ``MiMoV2ForCausalLM.kv_layout()`` (its own KV heads of each kind), as the engine uses it.

    weights   FP8 as stored: qkv, dense MLP and expert projections 1 byte + one fp32 scale per 128x128
              block; the rest bf16 (embeddings, LM head, o_proj, norms, sinks) and the router fp32.
              served: what mmserve holds by default on sm_89+ GPUs (``--fp8-experts``): the routed experts as
              stored (the shard built with ``expert_fp8_block``, its parameters and block-factor
              buffers counted as they are), every other FP8 weight dequantised to bf16 at load.
              bf16: everything dequantised at load (``--no-fp8-experts``; docs/model.md §2.1).
    acts      one prefill step of ``--chunk`` tokens: residual + normed input, this rank's qkv and
              attention output, the MoE's gathered rows, gate/up, product and fp32 partial sums for its
              share of the (token, expert) pairs, and fp32 logits of ``--max-seqs`` rows (all-gathered).
    overhead  CUDA context, NCCL buffers, allocator slack: a fixed ``--overhead-gib``.
    KV        what is left of ``--usable`` x 141 GB. A 128K request costs its Full KV (every token on
              the 9 full layers, this rank's KV heads) + its SWA window (window + release interval + 2
              pages, 39 sliding layers); bf16.

Every rank serves every request (TP splits heads; EP splits experts; with tp = 1 attention and its KV are
replicated), so the per-GPU count is the whole server's count. MTP and the vision / audio encoders are
not counted (the loader skips MTP; encoders run data-parallel on their own device, docs/parallelism.md).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

from dataclasses import replace

import torch
from _common import base_parser, print_table, write_json
from kv_capacity import MIMO_V25

from llm_core.distributed.parallel_context import ParallelContext
from llm_core.model.config import ModelConfig
from llm_core.model.mimo_v2 import MiMoV2ForCausalLM

GB = 1e9
GPU_BYTES = 141e9
CONTEXT = 128 * 1024
FP8_SUFFIXES = ("qkv_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                "experts.gate_up_proj", "experts.down_proj")
CHOICES = [(1, 1), (8, 1), (1, 8), (8, 8), (8, 2), (8, 4)]  # (tp, ep); world = max(tp, ep)


def rank_weights(config: ModelConfig, ctx: ParallelContext) -> tuple[int, int, int, MiMoV2ForCausalLM]:
    """(bytes as stored with FP8 blocks, as served with FP8 experts, served all in bf16) of one rank's
    shard, and the shard."""
    with torch.device("meta"):
        model = MiMoV2ForCausalLM(config, ctx)
        kept = MiMoV2ForCausalLM(replace(config, expert_fp8_block=(128, 128)), ctx).cast_(torch.bfloat16)
    # parameters as the engine holds them (experts fp8, router fp32, the rest bf16) + the experts' block factors
    served = sum(t.numel() * t.element_size() for t in kept.parameters()) + sum(
        b.numel() * b.element_size() for n, b in kept.named_buffers() if n.endswith("_scale_inv"))
    fp8 = bf16 = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if getattr(_owner(model, name), "FP32", False):  # the router stays fp32 (Router.FP32)
            fp8 += 4 * n
            bf16 += 4 * n
        elif name.endswith(FP8_SUFFIXES):
            fp8 += n + 4 * -(-n // (128 * 128))
            bf16 += 2 * n
        else:
            fp8 += 2 * n
            bf16 += 2 * n
    return fp8, served, bf16, model


def _owner(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0])


def activation_bytes(config: ModelConfig, ctx: ParallelContext, chunk: int, max_seqs: int) -> int:
    h, e = config.hidden_size, 2
    spec = ctx.heads(config.swa_attn, "sliding").local  # the larger qkv of the two kinds
    qkv = spec.q_size + spec.k_size + spec.v_size
    inter = config.moe_intermediate_size // ctx.moe_tp_size
    pairs = chunk * config.top_k // ctx.ep_size  # this rank's (token, expert) pairs, on average
    moe = pairs * (h * e + 2 * inter * e + inter * e + h * 4)
    return 3 * chunk * h * e + chunk * qkv * e + chunk * spec.num_heads * spec.v_head_dim * e + moe \
        + max_seqs * config.vocab_size * 4


def request_kv_bytes(model: MiMoV2ForCausalLM, page: int = 16, release: int = 16) -> tuple[int, int]:
    """(Full KV bytes of one 128K request on this rank, its SWA window bytes)."""
    layout = model.kv_layout()
    full = CONTEXT * layout.full_bytes_per_token(torch.bfloat16)
    swa_tokens = layout.window + release + 2 * page
    return full, swa_tokens * layout.swa_bytes_per_token(torch.bfloat16)


def plan(chunk: int, max_seqs: int, usable: float, overhead_gib: float, gpu_gb: float = GPU_BYTES / GB) -> list[dict]:
    config = ModelConfig.from_hf(MIMO_V25)
    rows = []
    for tp, ep in CHOICES:
        ctx = ParallelContext(tp, ep, rank=0)
        fp8, served, bf16, model = rank_weights(config, ctx)
        acts = activation_bytes(config, ctx, chunk, max_seqs)
        full_kv, swa_kv = request_kv_bytes(model)
        per_req = full_kv + swa_kv
        fixed = acts + overhead_gib * (1 << 30)
        left = {k: usable * gpu_gb * GB - w - fixed for k, w in (("fp8", fp8), ("served", served), ("bf16", bf16))}
        rows.append({"tp": tp, "ep": ep, "gpus": ctx.world_size, "weights_fp8_gb": fp8 / GB,
                     "weights_served_gb": served / GB, "weights_bf16_gb": bf16 / GB, "activations_gb": acts / GB,
                     "kv_per_128k_request_gb": per_req / GB,
                     **{f"requests_128k_{k}": max(0, int(b // per_req)) for k, b in left.items()}})
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=16384, help="prefill tokens of one step (activations)")
    p.add_argument("--max-seqs", type=int, default=256, help="rows of logits in one step")
    p.add_argument("--usable", type=float, default=0.9, help="share of the GPU's memory the server may use")
    p.add_argument("--gpu-gb", type=float, default=GPU_BYTES / GB, help="memory of one GPU in GB (H200 141, H100 80)")
    p.add_argument("--overhead-gib", type=float, default=4.0, help="CUDA context, NCCL, allocator slack")
    args = p.parse_args()
    rows = plan(args.chunk, args.max_seqs, args.usable, args.overhead_gib, args.gpu_gb)
    cols = list(rows[0])
    print_table(f"MiMo-V2.5 per GPU of {args.gpu_gb:g} GB (usable {args.usable:.0%}), {args.chunk}-token prefill step, "
                f"bf16 KV, 128K-context requests", cols, [[r[c] for c in cols] for r in rows])
    write_json(args.json, {f"tp{r['tp']}_ep{r['ep']}_{k}": v for r in rows for k, v in r.items()
                           if k not in ("tp", "ep")})


if __name__ == "__main__":
    main()
