"""Parsing of the two config.json spellings into :class:`llm_core.model.config.ModelConfig` fields.

Kept apart from the dataclass so config.py reads as the data it defines. Every missing or unsupported
field raises ValueError naming it.
"""

from __future__ import annotations

from typing import Any

from llm_core.model.config import AttentionSpec, Fp8Spec

_HF_ATTN = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_MLP = {"dense": "dense", "sparse": "moe"}
ATTN_KIND_ORDER = ("full", "sliding")
# transformers' MiMoV2FlashConfig defaults, used when a field is absent (they match MiMo-V2-Flash).
_DEFAULT_ROPE = {"full": 5_000_000.0, "sliding": 10_000.0}
_DEFAULT_PARTIAL_ROTARY = 0.334


def uses_hub_spelling(cfg: dict) -> bool:
    """Hub mimo_v2 configs carry the hybrid pattern and/or explicit swa_* head fields."""
    return any(k in cfg for k in ("hybrid_layer_pattern", "swa_num_attention_heads", "moe_layer_freq"))


def _req(cfg: dict, name: str) -> Any:
    if cfg.get(name) is None:
        raise ValueError(f"config.json lacks required field {name!r}")
    return cfg[name]


def _default_layer_kinds(n: int) -> tuple[str, ...]:
    # MiMo-V2 rule (both HF and the hub pattern): layer 0 and every 6th layer are full attention.
    return tuple("full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(n))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _check_common(cfg: dict) -> None:
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (MiMo-V2 has no attention bias)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; expected 'silu'")


def _fp8(cfg: dict) -> Fp8Spec | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; expected 'fp8'")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported; expected 'e4m3'")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return Fp8Spec(block_size=(int(block[0]), int(block[1])))


def _rotary_dim(head_dim: int, factor: float) -> int:
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return int(head_dim * factor)  # int() truncation as HF: int(192 * 0.334) = 64


def _sliding_window(cfg: dict) -> int:
    # Hub `sliding_window_size` = W previous tokens -> W + 1 visible keys (transformers converts the
    # same way). Without it, `sliding_window` is taken as transformers reads it: keys incl. the query.
    size = cfg.get("sliding_window_size")
    if size is not None:
        return int(size) + 1
    return int(cfg.get("sliding_window", 129))


def _moe_fields(cfg: dict) -> dict[str, Any]:
    scaling = cfg.get("routed_scaling_factor")
    return dict(
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
        num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0))),
        top_k=int(cfg.get("num_experts_per_tok", 0)),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=1.0 if scaling is None else float(scaling),  # hub stores null
    )


def _common_fields(cfg: dict) -> dict[str, Any]:
    n = int(_req(cfg, "num_hidden_layers"))
    vscale = cfg.get("attention_value_scale")
    return dict(
        vocab_size=int(_req(cfg, "vocab_size")),
        hidden_size=int(_req(cfg, "hidden_size")),
        num_layers=n,
        sliding_window=_sliding_window(cfg),
        value_scale=1.0 if vscale is None else float(vscale),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        fp8=_fp8(cfg),
        **_moe_fields(cfg),
    )


def _kinds(cfg: dict, field: str, mapping: dict, n: int) -> tuple[str, ...]:
    values = cfg[field]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{field} must be a list of {n} entries (num_hidden_layers), got {values!r}")
    out = []
    for i, v in enumerate(values):
        if v not in mapping:
            raise ValueError(f"{field}[{i}] = {v!r}; expected one of {sorted(mapping, key=str)}")
        out.append(mapping[v])
    return tuple(out)


def _hf_rope(cfg: dict, kind: str) -> tuple[float, float]:
    """(theta, partial_rotary_factor) of one kind from HF `rope_parameters` (per kind or flat)."""
    params = cfg.get("rope_parameters")
    if params is None:
        return _DEFAULT_ROPE[kind], _DEFAULT_PARTIAL_ROTARY
    hf_kind = {v: k for k, v in _HF_ATTN.items()}[kind]
    per_kind = params.get(hf_kind, params) if isinstance(params, dict) else None
    if not isinstance(per_kind, dict) or "rope_theta" not in per_kind:
        raise ValueError(f"rope_parameters[{hf_kind!r}] lacks rope_theta: {params!r}")
    if per_kind.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters[{hf_kind!r}].rope_type {per_kind['rope_type']!r} is not supported")
    return float(per_kind["rope_theta"]), float(per_kind.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))


def parse_hf_dict(cfg: dict) -> dict[str, Any]:
    """transformers `mimo_v2_flash` spelling (save_pretrained of MiMoV2FlashConfig)."""
    _check_common(cfg)
    fields = _common_fields(cfg)
    n = fields["num_layers"]
    layer_kinds = _kinds(cfg, "layer_types", _HF_ATTN, n) if cfg.get("layer_types") else _default_layer_kinds(n)
    mlp_kinds = (
        _kinds(cfg, "mlp_layer_types", _HF_MLP, n) if cfg.get("mlp_layer_types") else ("dense",) + ("moe",) * (n - 1)
    )
    heads = int(_req(cfg, "num_attention_heads"))
    kv = int(_req(cfg, "num_key_value_heads"))
    head_dim = int(cfg.get("head_dim") or 192)
    v_head_dim = int(cfg.get("v_head_dim") or 128)
    specs = {}
    for kind in ATTN_KIND_ORDER:
        theta, factor = _hf_rope(cfg, kind)
        specs[kind] = AttentionSpec(
            num_heads=heads,
            # HF quirk: sliding layers have twice the configured KV heads and always sinks.
            num_kv_heads=kv * 2 if kind == "sliding" else kv,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            rope_theta=theta,
            rotary_dim=_rotary_dim(head_dim, factor),
            has_sinks=kind == "sliding",
        )
    return dict(
        fields,
        layer_kinds=layer_kinds,
        mlp_kinds=mlp_kinds,
        full_attn=specs["full"],
        swa_attn=specs["sliding"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_layout="split",
        fused_qkv_chunks=kv,
    )



def parse_hub_dict(cfg: dict) -> dict[str, Any]:
    """Hub `mimo_v2` / MiMo-V2.5 spelling (see docs/model.md §1.1)."""
    _check_common(cfg)
    fields = _common_fields(cfg)
    n = fields["num_layers"]
    layer_kinds = (
        _kinds(cfg, "hybrid_layer_pattern", {0: "full", 1: "sliding"}, n)
        if cfg.get("hybrid_layer_pattern") is not None
        else _default_layer_kinds(n)
    )
    mlp_kinds = (
        _kinds(cfg, "moe_layer_freq", {0: "dense", 1: "moe"}, n)
        if cfg.get("moe_layer_freq") is not None
        else ("dense",) + ("moe",) * (n - 1)
    )
    heads = int(_req(cfg, "num_attention_heads"))
    kv = int(_req(cfg, "num_key_value_heads"))
    head_dim = int(cfg.get("head_dim") or 192)
    v_head_dim = int(cfg.get("v_head_dim") or 128)
    swa_head_dim = int(cfg.get("swa_head_dim") or head_dim)
    factor = float(cfg.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
    rope_scaling = cfg.get("rope_scaling") or {}
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
        raise ValueError(f"rope_scaling {rope_scaling!r} is not supported; only 'default' rope")
    full = AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        rope_theta=float(cfg.get("rope_theta", _DEFAULT_ROPE["full"])),
        rotary_dim=_rotary_dim(head_dim, factor),
        has_sinks=bool(cfg.get("add_full_attention_sink_bias", False)),
    )
    swa = AttentionSpec(
        num_heads=int(cfg.get("swa_num_attention_heads") or heads),
        num_kv_heads=int(cfg.get("swa_num_key_value_heads") or 2 * kv),
        head_dim=swa_head_dim,
        v_head_dim=int(cfg.get("swa_v_head_dim") or v_head_dim),
        rope_theta=float(cfg.get("swa_rope_theta", _DEFAULT_ROPE["sliding"])),
        rotary_dim=_rotary_dim(swa_head_dim, factor),
        has_sinks=bool(cfg.get("add_swa_attention_sink_bias", True)),
    )
    layout = cfg.get("attention_projection_layout", "split_qkv")
    if layout not in ("fused_qkv", "split_qkv", "split"):
        raise ValueError(f"attention_projection_layout {layout!r}; expected 'fused_qkv' or 'split_qkv'")
    return dict(
        fields,
        layer_kinds=layer_kinds,
        mlp_kinds=mlp_kinds,
        full_attn=full,
        swa_attn=swa,
        rms_norm_eps=float(cfg.get("layernorm_epsilon", cfg.get("rms_norm_eps", 1e-5))),
        qkv_layout="fused" if layout == "fused_qkv" else "split",
        # sglang: the fused qkv is "TP=num_key_value_heads"-interleaved (4 for MiMo-V2.5).
        fused_qkv_chunks=kv,
    )
