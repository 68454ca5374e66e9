"""Text-model configuration: one frozen dataclass normalised once from a checkpoint's config.json.

Two config spellings exist for the MiMo-V2 family and both normalise to the same :class:`ModelConfig`:

* transformers ``mimo_v2_flash`` (what ``MiMoV2FlashConfig.save_pretrained`` writes): ``layer_types``,
  ``mlp_layer_types``, ``rope_parameters`` per kind, ``sliding_window`` (visible keys incl. the query),
  one head config where SWA layers implicitly get 2x ``num_key_value_heads`` and always have sinks.
* the hub ``mimo_v2`` / MiMo-V2.5 spelling: ``hybrid_layer_pattern`` (0 full, 1 sliding),
  ``moe_layer_freq`` (0 dense, 1 MoE), ``swa_*`` head fields, ``rope_theta`` / ``swa_rope_theta``,
  ``sliding_window_size`` (= W *previous* tokens, i.e. W + 1 visible keys), sink flags per kind,
  ``layernorm_epsilon``, a fused ``qkv_proj`` and FP8 block ``quantization_config``.

The window is stored in transformers semantics everywhere in mmserve:

    query at position i sees keys j with  i - sliding_window < j <= i
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ATTN_KINDS = ("full", "sliding")
MLP_KINDS = ("dense", "moe")
QKV_LAYOUTS = ("split", "fused")


def layers_of_kind(layer_kinds: tuple[str, ...], kind: str) -> tuple[int, ...]:
    """Indices of the layers of one attention kind ("full" / "sliding") in a hybrid layout."""
    return tuple(i for i, k in enumerate(layer_kinds) if k == kind)


class ModelConfigError(ValueError):
    """A checkpoint's config.json that cannot be used (not JSON, a required field missing or
    unsupported): a problem of the checkpoint the user named, not of this code."""


def read_config_json(model_dir: str | Path, parse):
    """``parse(dict)`` of ``model_dir/config.json``; its problems as ``ModelConfigError`` naming the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    try:
        return parse(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
        raise ModelConfigError(f"{path} cannot be used: {exc}") from exc


@dataclass(frozen=True)
class AttentionSpec:
    """Head geometry and position encoding of one attention kind (full or sliding)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k dim per head; the softmax scale is head_dim ** -0.5
    v_head_dim: int
    rope_theta: float
    rotary_dim: int  # NeoX rotate-half over the first rotary_dim dims of each q/k head
    has_sinks: bool

    def validate(self, kind: str) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{kind} attention: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{kind} attention: num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"{kind} attention: rotary_dim {self.rotary_dim} must be even and <= head_dim")
        if self.rope_theta <= 0:
            raise ValueError(f"{kind} attention: rope_theta must be positive, got {self.rope_theta}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def k_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def v_size(self) -> int:
        return self.num_kv_heads * self.v_head_dim


@dataclass(frozen=True)
class Fp8Spec:
    """Block-wise FP8 (e4m3) weights: W ~= fp8 * weight_scale_inv per (rows x cols) block."""

    block_size: tuple[int, int]


@dataclass(frozen=True)
class ModelConfig:
    """Everything the text model, the KV pools and the loader need; the hybrid layout is data."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[str, ...]  # "full" | "sliding", per layer
    sliding_window: int  # visible keys incl. the query (transformers semantics)
    full_attn: AttentionSpec
    swa_attn: AttentionSpec
    value_scale: float
    mlp_kinds: tuple[str, ...]  # "dense" | "moe", per layer
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    # Checkpoint layout: "split" q/k/v_proj tensors, or one "fused" qkv_proj (hub MiMo-V2.5).
    qkv_layout: str = "split"
    # The fused qkv was written (and FP8-quantised) in this many independent row chunks, one per
    # attention-TP rank of the training setup: sglang reads it as the full-attention KV head count (4).
    fused_qkv_chunks: int = 1
    fp8: Fp8Spec | None = None
    # A serving choice, not the checkpoint's: the routed experts kept as block-FP8 values with these
    # (bn, bk) blocks instead of in the model's dtype (llm_core/model/loader.py sets it; None: not).
    expert_fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "sliding_window", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
        if len(self.mlp_kinds) != self.num_layers:
            raise ValueError(f"mlp_kinds has {len(self.mlp_kinds)} entries for {self.num_layers} layers")
        for i, kind in enumerate(self.layer_kinds):
            if kind not in ATTN_KINDS:
                raise ValueError(f"layer_kinds[{i}] = {kind!r}; expected one of {ATTN_KINDS}")
        for i, kind in enumerate(self.mlp_kinds):
            if kind not in MLP_KINDS:
                raise ValueError(f"mlp_kinds[{i}] = {kind!r}; expected one of {MLP_KINDS}")
        self.full_attn.validate("full")
        self.swa_attn.validate("sliding")
        if self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"qkv_layout {self.qkv_layout!r}; expected one of {QKV_LAYOUTS}")
        if self.fused_qkv_chunks <= 0:
            raise ValueError(f"fused_qkv_chunks must be positive, got {self.fused_qkv_chunks}")
        if "dense" in self.mlp_kinds and self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")
        if "moe" in self.mlp_kinds:
            self._validate_moe()

    def _validate_moe(self) -> None:
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_group <= 0 or self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide num_experts {self.num_experts}")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group {self.topk_group} groups hold fewer than top_k {self.top_k} experts")

    # ---- per-layer views -------------------------------------------------------------------------

    def attn_spec(self, layer: int) -> AttentionSpec:
        return self.full_attn if self.layer_kinds[layer] == "full" else self.swa_attn

    def window_of(self, layer: int) -> int | None:
        """Visible keys incl. the query for sliding layers; None for full layers."""
        return self.sliding_window if self.layer_kinds[layer] == "sliding" else None

    @property
    def full_layers(self) -> tuple[int, ...]:
        return layers_of_kind(self.layer_kinds, "full")

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return layers_of_kind(self.layer_kinds, "sliding")

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Normalise a config.json dict in either spelling (see module doc); validates."""
        from llm_core.model.config_parse import parse_hf_dict, parse_hub_dict, uses_hub_spelling

        fields = parse_hub_dict(cfg) if uses_hub_spelling(cfg) else parse_hf_dict(cfg)
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        return read_config_json(model_dir, cls.from_hf)
