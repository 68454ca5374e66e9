"""Tiny random MiMo-V2 checkpoints for tests, in both on-disk layouts (fast: well under a second).

* :func:`build_tiny_hf_checkpoint` — ``save_pretrained`` of a random transformers
  ``MiMoV2FlashForCausalLM`` (split q/k/v, per-expert experts, ``layer_types`` config).
* :func:`write_hub_layout` — the same weights in the hub ``mimo_v2`` / MiMo-V2.5 spelling: fused
  ``qkv_proj`` in a chosen row order, hub config fields, two shard files with an index, optional FP8
  block weights with ``weight_scale_inv``.

The tiny shape keeps the real model's asymmetries: q/k head dim 24 != v head dim 16, sliding layers
with twice the full layers' KV heads and sinks, 2 full layers of 6 (layer 0 and 5), window 8,
8 experts top-2, layer 0 dense. Weights use a larger init std than the default and random norm
weights / correction bias / sinks so a mis-mapped tensor changes the logits visibly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import quantize_blockwise, quantize_row_chunks
from llm_core.model.layers.fused_qkv import chunk_count, plain_rows_of_disk
from llm_core.model.mtp import sliding_layer_config

if TYPE_CHECKING:
    import transformers

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,  # full layers; HF gives sliding layers 2x -> 8
    head_dim=24,
    v_head_dim=16,
    sliding_window=8,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
    },
)
# FP8 blocks smaller than the real 128x128 so the tiny weights span several blocks and the fused qkv
# chunk padding shows up (full layers: 4 chunks x 88 rows -> 4 x 6 = 24 scale rows, not 22).
TINY_FP8_BLOCK = (16, 16)


def tiny_hf_config(**overrides: Any) -> "transformers.MiMoV2FlashConfig":
    """A tiny ``MiMoV2FlashConfig``; keyword overrides replace any default field."""
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(**{**TINY_DEFAULTS, **overrides})


def build_tiny_hf_checkpoint(out_dir: str | Path, *, seed: int = 0, mtp_layers: int = 0, **overrides: Any) -> Path:
    """save_pretrained of a random tiny HF model into ``out_dir``; returns the directory.

    ``mtp_layers`` > 0 adds that many random MTP layers (``model.mtp.layers.{j}.*``, split q/k/v as
    the main layers) in their own file ``model-mtp.safetensors`` (transformers ignores it)."""
    from transformers import MiMoV2FlashForCausalLM

    out = Path(out_dir)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MiMoV2FlashForCausalLM(tiny_hf_config(**overrides))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith("sinks"):
                    p.copy_(torch.randn_like(p))  # O(1) logits so the sink visibly takes mass
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn_like(b))
    finally:
        torch.random.set_rng_state(gen_state)
    model.save_pretrained(out)
    if mtp_layers:
        save_file(random_mtp_tensors(ModelConfig.from_pretrained(out), mtp_layers, seed=seed + 1),
                  str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    return out


def random_mtp_tensors(config: ModelConfig, num_layers: int, *, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    """Random MTP layers for ``config`` in the split q/k/v spelling (norms near 1, O(1) sinks)."""
    from llm_core.model.mtp import MTP_PREFIX, sliding_layer_config

    g = torch.Generator().manual_seed(seed)
    spec = sliding_layer_config(config).attn_spec(0)
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "final_layernorm.weight": (h,),
              "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
              "self_attn.q_proj.weight": (spec.q_size, h), "self_attn.k_proj.weight": (spec.k_size, h),
              "self_attn.v_proj.weight": (spec.v_size, h), "self_attn.o_proj.weight": (h, spec.num_heads * spec.v_head_dim),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    if spec.has_sinks:
        shapes["self_attn.attention_sink_bias"] = (spec.num_heads,)
    out = {}
    for j in range(num_layers):
        for name, shape in shapes.items():
            r = torch.randn(shape, generator=g)
            if name.endswith("norm.weight"):
                r = 1.0 + 0.2 * r
            elif not name.endswith("sink_bias"):
                r = std * r
            out[f"{MTP_PREFIX}{j}.{name}"] = r.contiguous()
    return out


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def hub_config_dict(config: ModelConfig, hf_cfg: dict, *, fp8_block: tuple[int, int] | None) -> dict[str, Any]:
    """The hub ``mimo_v2`` config.json for a model (spelling of docs/model.md §1.1)."""
    full, swa = config.full_attn, config.swa_attn
    # Without HF rope_parameters: a factor that int()-truncates back to rotary_dim exactly.
    factor = (full.rotary_dim + 0.5) / full.head_dim
    rope = hf_cfg.get("rope_parameters") or {}
    factors = {p.get("partial_rotary_factor", 0.334) for p in rope.values() if isinstance(p, dict)}
    if len(factors) > 1:
        raise ValueError(f"hub layout has one partial_rotary_factor; HF config has {sorted(factors)}")
    factor = factors.pop() if factors else factor
    cfg: dict[str, Any] = {
        "architectures": ["MiMoV2ForCausalLM"],
        "model_type": "mimo_v2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": full.num_heads,
        "num_key_value_heads": full.num_kv_heads,
        "head_dim": full.head_dim,
        "v_head_dim": full.v_head_dim,
        "swa_num_attention_heads": swa.num_heads,
        "swa_num_key_value_heads": swa.num_kv_heads,
        "swa_head_dim": swa.head_dim,
        "swa_v_head_dim": swa.v_head_dim,
        "attention_projection_layout": "fused_qkv",
        "attention_bias": False,
        "attention_value_scale": config.value_scale,
        "add_full_attention_sink_bias": full.has_sinks,
        "add_swa_attention_sink_bias": swa.has_sinks,
        # Hub counts *previous* tokens: W + 1 visible keys incl. the query.
        "sliding_window": config.sliding_window - 1,
        "sliding_window_size": config.sliding_window - 1,
        "hybrid_layer_pattern": [0 if k == "full" else 1 for k in config.layer_kinds],
        "moe_layer_freq": [0 if k == "dense" else 1 for k in config.mlp_kinds],
        "n_routed_experts": config.num_experts,
        "n_shared_experts": None,
        "num_experts_per_tok": config.top_k,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": None if config.routed_scaling_factor == 1.0 else config.routed_scaling_factor,
        "partial_rotary_factor": factor,
        "rope_theta": full.rope_theta,
        "swa_rope_theta": swa.rope_theta,
        "rope_scaling": {"rope_type": "default", "type": "default"},
        "max_position_embeddings": config.max_position_embeddings,
        "layernorm_epsilon": config.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
    }
    if fp8_block is not None:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
            "ignored_layers": [f"model.layers.{i}.self_attn.o_proj" for i in range(config.num_layers)],
        }
    return cfg


def _is_fp8_target(name: str) -> bool:
    # As on the hub: qkv and MLP/expert projections are FP8; o_proj, router, norms, embeddings are not.
    return name.endswith(("qkv_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"))


def write_hub_layout(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    fp8: bool = False,
    qkv_row_order: str = "tp4_chunks",
    fp8_block: tuple[int, int] = TINY_FP8_BLOCK,
) -> Path:
    """Rewrite an HF-layout checkpoint in the hub layout (fused qkv in ``qkv_row_order``)."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    config = ModelConfig.from_hf(hf_cfg)
    src = _read_all(hf_dir)
    dst: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        spec, p = config.attn_spec(i), f"model.layers.{i}.self_attn."
        plain = torch.cat([src.pop(p + "q_proj.weight"), src.pop(p + "k_proj.weight"), src.pop(p + "v_proj.weight")])
        inv = plain_rows_of_disk(spec, chunk_count(spec, config.fused_qkv_chunks, qkv_row_order))
        dst[p + "qkv_proj.weight"] = plain[inv].contiguous()
    mtp_spec = sliding_layer_config(config).attn_spec(0)
    for p in sorted({n[: n.index("self_attn.") + len("self_attn.")] for n in src
                     if n.startswith("model.mtp.") and n.endswith("q_proj.weight")}):
        plain = torch.cat([src.pop(p + "q_proj.weight"), src.pop(p + "k_proj.weight"), src.pop(p + "v_proj.weight")])
        dst[p + "qkv_proj.weight"] = plain[plain_rows_of_disk(
            mtp_spec, chunk_count(mtp_spec, config.fused_qkv_chunks, qkv_row_order))].contiguous()
    dst.update(src)
    if fp8:
        for name in [n for n in dst if _is_fp8_target(n)]:
            w = dst[name]
            if name.endswith("qkv_proj.weight"):
                q, s = quantize_row_chunks(w, fp8_block, config.fused_qkv_chunks)
            else:
                q, s = quantize_blockwise(w, fp8_block)
            dst[name], dst[name + "_scale_inv"] = q, s
    out.mkdir(parents=True, exist_ok=True)
    # Two shards (experts apart, as the real checkpoint spreads experts over files) plus an index.
    # MTP layers, when there are any, in their own file like the real checkpoint's model_mtp.safetensors.
    shards = {"model-experts.safetensors": {}, "model-main.safetensors": {}, "model-mtp.safetensors": {}}
    for name, t in dst.items():
        shards["model-mtp.safetensors" if name.startswith("model.mtp.") else
               "model-experts.safetensors" if ".experts." in name else "model-main.safetensors"][name] = t
    weight_map = {}
    for fname, tensors in shards.items():
        if not tensors:
            continue
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    hub_cfg = hub_config_dict(config, hf_cfg, fp8_block=fp8_block if fp8 else None)
    (out / "config.json").write_text(json.dumps(hub_cfg, indent=2))
    return out
