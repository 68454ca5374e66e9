"""Load a MiMo-V2 checkpoint directory (either layout, optionally FP8) into :class:`MiMoV2ForCausalLM`.

The model is built on the meta device, materialised once on the target device, and each checkpoint
tensor (read lazily through safetensors' mmap) is written straight into its slice of a parameter:

    checkpoint tensor                                  -> parameter slice
    ...self_attn.q_proj / k_proj / v_proj.weight       -> ...self_attn.qkv_proj.weight rows [Q | K | V]
    ...self_attn.qkv_proj.weight   (hub, fused)        -> whole, rows permuted from the disk order
    ...mlp.experts.{e}.gate_proj / up_proj.weight      -> ...mlp.experts.gate_up_proj[e, :I] / [e, I:]
    ...mlp.experts.{e}.down_proj.weight                -> ...mlp.experts.down_proj[e]
    X.weight + X.weight_scale_inv  (FP8 blocks)        -> dequantised (multiply) before placing
    model.mtp.layers.{j}.*  (when the checkpoint has them) -> model.model.mtp (llm_core/model/mtp.py),
                                                          the same conversions as a sliding layer
    anything else                                      -> the parameter / buffer of the same name

The expected tensor names are derived from the config; a missing or unexpected name is an error that
names it. The router (``mlp.gate``) stays fp32 whatever ``dtype`` is.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import FP8_DTYPE, dequantize_blockwise, dequantize_row_chunks
from llm_core.model.layers.fused_qkv import chunk_count, disk_rows_of_plain
from llm_core.model.mimo_v2 import MiMoV2ForCausalLM
from llm_core.model.mtp import MTP_PREFIX, MTPHead, mtp_layer_count, sliding_layer_config

# Tensors of other parts of a MiMo-V2.5 checkpoint (vision tower, audio stack): not ours.
IGNORED_PREFIXES = ("visual.", "speech_embeddings.", "audio_encoder.")
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: ``param[index] = tensor[row_perm]``."""

    target: str
    index: tuple = ()
    row_perm: torch.Tensor | None = None
    quant_chunks: int = 1  # FP8 scale row chunks (fused qkv only)


def expected_tensors(config: ModelConfig, qkv_row_order: str = "tp4_chunks") -> dict[str, Placement]:
    """Every tensor name a checkpoint of ``config`` must hold, with its placement."""
    plan: dict[str, Placement] = {"model.embed_tokens.weight": Placement("model.embed_tokens.weight")}
    plan["model.norm.weight"] = Placement("model.norm.weight")
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = Placement("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            plan[p + name] = Placement(p + name)
        _attention_plan(plan, p, config.attn_spec(i), config, qkv_row_order)
        if config.mlp_kinds[i] == "dense":
            for name in ("gate_proj", "up_proj", "down_proj"):
                plan[f"{p}mlp.{name}.weight"] = Placement(f"{p}mlp.{name}.weight")
            continue
        plan[p + "mlp.gate.weight"] = Placement(p + "mlp.gate.weight")
        plan[p + "mlp.gate.e_score_correction_bias"] = Placement(p + "mlp.gate.e_score_correction_bias")
        inter = config.moe_intermediate_size
        gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
        for e in range(config.num_experts):
            plan[f"{p}mlp.experts.{e}.gate_proj.weight"] = Placement(gate_up, (e, slice(0, inter)))
            plan[f"{p}mlp.experts.{e}.up_proj.weight"] = Placement(gate_up, (e, slice(inter, 2 * inter)))
            plan[f"{p}mlp.experts.{e}.down_proj.weight"] = Placement(down, (e,))
    return plan


def _attention_plan(plan: dict[str, Placement], p: str, spec, config: ModelConfig, qkv_row_order: str) -> None:
    """Placements of one attention block under prefix ``p`` (fused or split qkv, o_proj, sinks)."""
    plan[p + "self_attn.o_proj.weight"] = Placement(p + "self_attn.o_proj.weight")
    qkv = p + "self_attn.qkv_proj.weight"
    if config.qkv_layout == "fused":
        chunks = chunk_count(spec, config.fused_qkv_chunks, qkv_row_order)
        perm = disk_rows_of_plain(spec, chunks)
        plan[qkv] = Placement(qkv, row_perm=perm, quant_chunks=config.fused_qkv_chunks)
    else:
        q, k, v = spec.q_size, spec.k_size, spec.v_size
        plan[p + "self_attn.q_proj.weight"] = Placement(qkv, (slice(0, q),))
        plan[p + "self_attn.k_proj.weight"] = Placement(qkv, (slice(q, q + k),))
        plan[p + "self_attn.v_proj.weight"] = Placement(qkv, (slice(q + k, q + k + v),))
    if spec.has_sinks:
        plan[p + "self_attn.attention_sink_bias"] = Placement(p + "self_attn.attention_sink_bias")


def expected_mtp_tensors(config: ModelConfig, num_layers: int, qkv_row_order: str = "tp4_chunks") -> dict[str, Placement]:
    """Every tensor of ``num_layers`` MTP layers (docs/model.md §2.2). Their attention is a sliding
    layer's, so its qkv (fused or split, FP8 or not) is read exactly like a main sliding layer's; the
    split spelling (``q_proj`` / ``k_proj`` / ``v_proj``) is what an HF-layout checkpoint would use
    (transformers' mimo_v2_flash defines no MTP of its own)."""
    spec = sliding_layer_config(config).attn_spec(0)
    plan: dict[str, Placement] = {}
    for j in range(num_layers):
        p = f"{MTP_PREFIX}{j}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
                     "pre_mlp_layernorm.weight", "final_layernorm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            plan[p + name] = Placement(p + name)
        _attention_plan(plan, p, spec, config, qkv_row_order)
    return plan


class ShardReader:
    """All ``*.safetensors`` files of a directory as one lazy name -> tensor mapping (mmap)."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        self._stack = ExitStack()
        self._file_of: dict[str, object] = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():
                if name in self._file_of:
                    raise ValueError(f"tensor {name} appears in two shard files (second: {path.name})")
                self._file_of[name] = handle

    def names(self) -> set[str]:
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        return self._file_of[name].get_tensor(name)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _check_names(plan: dict[str, Placement], present: set[str], config: ModelConfig) -> None:
    missing = sorted(set(plan) - present)
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        n
        for n in present - set(plan) - allowed_extra
        if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in plan)
    )
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            more = " ..." if len(names) > 8 else ""
            problems.append(f"{label} tensors ({len(names)}): {', '.join(names[:8])}{more}")
    if problems:
        raise ValueError("checkpoint does not match its config: " + "; ".join(problems))


def _read(reader: ShardReader, name: str, place: Placement, config: ModelConfig) -> torch.Tensor:
    """The checkpoint tensor in our row order, dequantised when it carries a weight_scale_inv."""
    t = reader.get(name)
    scale_name = name + SCALE_SUFFIX
    if scale_name in reader:
        if config.fp8 is None:
            raise ValueError(f"{scale_name} present but config.json has no fp8 quantization_config")
        scale = reader.get(scale_name)
        block = config.fp8.block_size
        if place.row_perm is not None:
            t = dequantize_row_chunks(t, scale, block, place.quant_chunks, name=name)
        else:
            t = dequantize_blockwise(t, scale, block, name=name)
    elif t.dtype == FP8_DTYPE:
        raise ValueError(f"{name} is FP8 but the checkpoint has no {scale_name}")
    return t if place.row_perm is None else t[place.row_perm]


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    qkv_row_order: str = "tp4_chunks",
    ignore_prefixes: tuple[str, ...] = IGNORED_PREFIXES,
    load_mtp: bool = True,
) -> MiMoV2ForCausalLM:
    """Build the model from ``model_dir/config.json`` and load its safetensors weights.

    ``qkv_row_order`` reads a fused hub ``qkv_proj`` as ``"tp4_chunks"`` (sglang) or ``"kv_groups"``
    (vLLM); see llm_core/model/layers/fused_qkv.py. It does not matter for split q/k/v checkpoints.
    Tensor names starting with ``ignore_prefixes`` (vision, audio parts) are skipped. MTP layers
    (``model.mtp.layers.{j}.*``) are loaded into ``model.model.mtp`` when present (``load_mtp=False``
    skips them); llm_core/engine/speculative/ drafts with them.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    plan = expected_tensors(config, qkv_row_order)
    with ShardReader(model_dir) as reader:
        present = {n for n in reader.names() if not n.startswith(ignore_prefixes)}
        num_mtp = mtp_layer_count(present) if load_mtp else 0
        if not load_mtp:
            present = {n for n in present if not n.startswith(MTP_PREFIX)}
        plan |= expected_mtp_tensors(config, num_mtp, qkv_row_order)
        _check_names(plan, present, config)
        with torch.device("meta"):
            model = MiMoV2ForCausalLM(config)
            if num_mtp:
                model.model.mtp = MTPHead(config, num_mtp)
        model.cast_(dtype)
        model.to_empty(device=device)
        model.tie_weights_()  # to_empty() gives tied parameters separate storage again
        targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        with torch.no_grad():
            for name, place in plan.items():
                tensor = _read(reader, name, place, config)
                dest = targets[place.target].data[place.index]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} in the checkpoint, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))
    return model.eval()
