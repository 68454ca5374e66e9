"""KV bytes per context token and context tokens per GB: dual pool vs an all-full-attention layout.

Geometry: the real MiMo-V2.5 config.json values (docs/model.md §1.1) through ModelConfig.from_hf; no
weights. Pools live on the ``meta`` device, so nothing is allocated but every byte is counted from
the real buffer shapes. One request is driven through the real Scheduler: chunked prefill to
``context - decode`` tokens, then ``decode`` single-token steps. We report the steady decode state
(the largest KV footprint seen after any decode step) and the transient prefill peak.

The all-full baseline is the same model whose sliding layers keep every token: the same pools with the
scheduler's window switched off (nothing is ever released).

Default split: what ``LLMEngine`` builds with no pool flags (``llm_engine.pool_sizing``, the same
function), for the demo model (float32 on CPU: the fixed default space, capped at what
``max_num_seqs`` requests of its context can use) and MiMo-V2.5 (bf16 with an example 60 GiB budget,
80 GB GPU x ``memory_fraction``-style): tokens and bytes per pool, SWA / Full, the longest context.

Theory (blog): dual keeps W = 128 SWA tokens, so ratio = (F + S) L / (F L + S W) = 7.6 / 9.35 / 9.6 at
4K / 32K / 128K. Measured ratios are a little lower: our window is 129 visible keys, pages round up
and decode releases SWA pages every ``swa_release_interval`` tokens.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json

from llm_core.engine.engine_config import EngineConfig, pool_sizing
from llm_core.model.config import ModelConfig
from llm_core.kvcache.dual_pool import DualKVPool, KVLayout
from llm_core.engine.request import Request
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.scheduler import Scheduler, SchedulerConfig

# docs/model.md §1.1 (attention / layout fields; MoE and rope fields only to pass validation)
MIMO_V25 = {
    "architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2", "vocab_size": 152576,
    "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192,
    "v_head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192,
    "swa_v_head_dim": 128, "attention_projection_layout": "fused_qkv", "attention_bias": False,
    "attention_value_scale": 0.707, "add_full_attention_sink_bias": False, "add_swa_attention_sink_bias": True,
    "sliding_window": 128, "sliding_window_size": 128,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": None, "partial_rotary_factor": 0.334,
    "rope_theta": 10000000, "swa_rope_theta": 10000, "max_position_embeddings": 1048576,
    "layernorm_epsilon": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 151645,
}
GB = 1e9
DEMO_MODEL = Path(__file__).resolve().parents[1] / "samples" / "demo-model"


def default_split(name: str, config: ModelConfig, dtype: torch.dtype, device: str, budget: int | None) -> dict:
    """The pools an engine builds with default EngineConfig sizing (``budget``: kv_cache_bytes)."""
    cfg = EngineConfig(kv_cache_bytes=budget)
    layout = KVLayout.from_model_config(config)
    max_len = config.max_position_embeddings
    sizes = pool_sizing(cfg, layout, dtype=dtype, device=device, max_model_len=max_len, prefix_caching=True)
    full_b = sizes.num_full_tokens * layout.full_bytes_per_token(dtype)
    swa_b = sizes.num_swa_tokens * layout.swa_bytes_per_token(dtype)
    return dict(model=name, full_tokens=sizes.num_full_tokens, swa_tokens=sizes.num_swa_tokens, full_bytes=full_b,
                swa_bytes=swa_b, swa_over_full=swa_b / full_b, max_context=min(max_len, sizes.num_full_tokens))


def measure(layout: KVLayout, context: int, *, dual: bool, page: int, chunk: int, interval: int,
            decode: int) -> tuple[int, int]:
    """(steady decode bytes, prefill peak bytes) of one request reaching ``context`` tokens."""
    pool = DualKVPool(layout, num_full_tokens=context + 2 * page, num_swa_tokens=context + 2 * page,
                      page_size=page, dtype=torch.bfloat16, device="meta")
    cfg = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=1, max_chunk_tokens=chunk,
                          swa_release_interval=interval)
    sched = Scheduler(cfg, pool, layout.window if dual else None)
    prompt = context - decode + 1  # the last sampled token is never computed
    req = Request("r", [1] * prompt, SamplingParams(max_tokens=decode, ignore_eos=True), 0)
    sched.add(req)

    def used() -> int:
        return page * (pool.full.num_used * pool.full_bytes_per_token + pool.swa.num_used * pool.swa_bytes_per_token)

    steady = peak = 0
    while not req.finished:
        batch = sched.schedule()
        peak = max(peak, used())  # pages of this step allocated, nothing released yet
        sched.after_step(batch)
        e = batch.entries[0]
        if e.samples:
            steady = max(steady, used())
            req.append_token(1, None, None)
            if req.check_stop(max_model_len=context + 1):
                sched.finish(req, "length")
    assert pool.all_free()
    return steady, peak


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--interval", type=int, default=16, help="SWA release interval while decoding")
    p.add_argument("--decode", type=int, default=64)
    args = p.parse_args()
    t0 = time.perf_counter()
    config = ModelConfig.from_hf(MIMO_V25)
    layout = KVLayout.from_model_config(config)
    f_tok = layout.full_bytes_per_token(torch.bfloat16)
    s_tok = layout.swa_bytes_per_token(torch.bfloat16)
    print(f"MiMo-V2.5 KV (bf16): {len(layout.full_layers)} full layers {f_tok:,} B/token, "
          f"{len(layout.swa_layers)} sliding layers {s_tok:,} B/token, window {layout.window} keys, "
          f"page {args.page_size}, chunk {args.chunk}, release every {args.interval} decode tokens")
    rows, results = [], {"page_size": args.page_size, "window": layout.window}
    for label, ctx in (("4k", 4096), ("32k", 32768), ("128k", 131072)):
        kw = dict(page=args.page_size, chunk=args.chunk, interval=args.interval, decode=args.decode)
        dual, dual_peak = measure(layout, ctx, dual=True, **kw)
        full, _ = measure(layout, ctx, dual=False, **kw)
        theory = (f_tok + s_tok) * ctx / (f_tok * ctx + s_tok * 128)
        ratio = full / dual
        rows.append([label, dual / ctx, full / ctx, GB * ctx / dual, GB * ctx / full, ratio, theory,
                     dual_peak / ctx])
        results.update({
            f"dual_bytes_per_token_{label}": dual / ctx, f"full_bytes_per_token_{label}": full / ctx,
            f"dual_tokens_per_gb_{label}": GB * ctx / dual, f"full_tokens_per_gb_{label}": GB * ctx / full,
            f"capacity_ratio_{label}": ratio, f"theory_ratio_{label}": theory,
            f"dual_prefill_peak_bytes_per_token_{label}": dual_peak / ctx,
        })
    print_table("KV per context token, one request at the end of decode",
                ["context", "dual B/tok", "all-full B/tok", "dual tok/GB", "all-full tok/GB", "ratio",
                 "theory", "dual prefill-peak B/tok"], rows)
    splits = [default_split("demo-model (cpu, f32, default space)", ModelConfig.from_pretrained(DEMO_MODEL),
                            torch.float32, "cpu", None),
              default_split("MiMo-V2.5 (bf16, 60 GiB)", config, torch.bfloat16, "cpu", 60 << 30)]
    print_table(f"default pool split (EngineConfig defaults: {EngineConfig().max_num_seqs} requests, "
                f"{EngineConfig().swa_checkpoint_reserve_windows} reserved SWA windows)",
                ["model", "Full tokens", "SWA tokens", "Full bytes", "SWA bytes", "SWA / Full", "max context"],
                [list(d.values()) for d in splits])
    for key, d in zip(("demo", "mimo_60gib"), splits):
        results.update({f"default_{key}_{k}": v for k, v in d.items() if k != "model"})
    results["wall_s"] = time.perf_counter() - t0
    print(f"\n{results['wall_s']:.1f} s")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
