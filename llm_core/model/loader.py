"""Load a MiMo-V2 checkpoint directory (either layout, optionally FP8) into :class:`MiMoV2ForCausalLM`.

The model is built on the meta device, materialised once on the target device, and each checkpoint
tensor (read lazily through safetensors' mmap) is written straight into its slice of a parameter:

    checkpoint tensor                                  -> parameter slice
    ...self_attn.q_proj / k_proj / v_proj.weight       -> ...self_attn.qkv_proj.weight rows [Q | K | V]
    ...self_attn.qkv_proj.weight   (hub, fused)        -> whole, rows permuted from the disk order
    ...mlp.experts.{e}.gate_proj / up_proj.weight      -> ...mlp.experts.gate_up_proj[e, :I] / [e, I:]
    ...mlp.experts.{e}.down_proj.weight                -> ...mlp.experts.down_proj[e]
    X.weight + X.weight_scale_inv  (FP8 blocks)        -> dequantised (multiply) before placing; with
                                                          fp8_experts an expert's values and block
                                                          factors are placed as stored (kernels/block_fp8.py)
    model.mtp.layers.{j}.*  (when the checkpoint has them) -> model.model.mtp (llm_core/model/mtp.py),
                                                          the same conversions as a sliding layer
    anything else                                      -> the parameter / buffer of the same name

The expected tensor names are derived from the config; a missing or unexpected name is an error that
names it. The router (``mlp.gate``) stays fp32 whatever ``dtype`` is.

Under tensor / expert parallelism (``parallel``) the model is built with this rank's shapes and each
placement names the rows / columns the rank needs (its heads' qkv rows through the disk permutation,
its o_proj / down_proj columns, its vocabulary rows, its experts); only those are read from disk
(llm_core/model/tensor_slices.py; docs/parallelism.md §4).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from llm_core.distributed.parallel_context import ParallelContext
from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import FP8_DTYPE
from llm_core.model.layers.fused_qkv import chunk_count, disk_rows_of_plain
from llm_core.model.mimo_v2 import MiMoV2ForCausalLM
from llm_core.model.mtp import MTP_PREFIX, MTPHead, mtp_layer_count, sliding_layer_config
from llm_core.model.tensor_slices import read_fp8_blocks, read_slice
from kernels.block_fp8 import BlockFP8, gpu_reads_e4m3

# Tensors of other parts of a MiMo-V2.5 checkpoint (vision tower, audio stack): not ours.
IGNORED_PREFIXES = ("visual.", "speech_embeddings.", "audio_encoder.")
SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)  # experts quantised at load from a float checkpoint (DeepSeek-V3 / MiMo blocks)


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: ``param[index] = tensor[rows][:, cols]``.

    ``rows`` (checkpoint rows in the order the parameter wants them: a fused qkv's disk permutation,
    a tensor-parallel rank's head rows) and ``cols`` (a row-parallel rank's input columns) are None
    for "all"; a rank reads only these parts (llm_core/model/tensor_slices.py)."""

    target: str
    index: tuple = ()
    rows: torch.Tensor | None = None
    cols: tuple[int, int] | None = None
    quant_chunks: int = 1  # FP8 scale row chunks (fused qkv only)
    # an expert weight kept in block-FP8 (ModelConfig.expert_fp8_block): where its block factors go
    scale_target: str | None = None
    scale_index: tuple = ()


def _rows(start: int, stop: int, ctx: ParallelContext) -> torch.Tensor | None:
    """Rows [start, stop), or None (all) when this rank holds the whole tensor."""
    return None if ctx.world_size == 1 else torch.arange(start, stop)


def _attention_plan(plan: dict, layer: str, spec, kind: str, config: ModelConfig, qkv_row_order: str,
                    ctx: ParallelContext) -> None:
    """Placements of one attention block of the layer under prefix ``layer`` (fused or split qkv,
    o_proj, sinks): this rank's heads of a layer of ``kind`` (all of them in one process)."""
    p = layer + "self_attn."
    shard = ctx.heads(spec, kind)
    local, d, dv = shard.local, spec.head_dim, spec.v_head_dim
    q0, kv0 = shard.q_start, shard.kv_start
    lq, lk, lv = local.q_size, local.k_size, local.v_size
    # this rank's rows of the plain [Q | K | V] order: its q heads, its KV heads' k and v rows
    q_rows = torch.arange(q0 * d, q0 * d + lq)
    k_rows = torch.arange(kv0 * d, kv0 * d + lk)
    v_rows = torch.arange(kv0 * dv, kv0 * dv + lv)
    o_cols = None if ctx.tp_size == 1 else (q0 * dv, q0 * dv + local.num_heads * dv)
    plan[p + "o_proj.weight"] = Placement(p + "o_proj.weight", cols=o_cols)
    qkv = p + "qkv_proj.weight"
    if config.qkv_layout == "fused":
        chunks = chunk_count(spec, config.fused_qkv_chunks, qkv_row_order)
        plain = torch.cat([q_rows, spec.q_size + k_rows, spec.q_size + spec.k_size + v_rows])
        plan[qkv] = Placement(qkv, rows=disk_rows_of_plain(spec, chunks)[plain], quant_chunks=config.fused_qkv_chunks)
    else:
        whole = ctx.tp_size == 1
        plan[p + "q_proj.weight"] = Placement(qkv, (slice(0, lq),), rows=None if whole else q_rows)
        plan[p + "k_proj.weight"] = Placement(qkv, (slice(lq, lq + lk),), rows=None if whole else k_rows)
        plan[p + "v_proj.weight"] = Placement(qkv, (slice(lq + lk, lq + lk + lv),), rows=None if whole else v_rows)
    if spec.has_sinks:
        plan[p + "attention_sink_bias"] = Placement(p + "attention_sink_bias",
                                                    rows=_rows(q0, q0 + local.num_heads, ctx))


def expected_tensors(config: ModelConfig, qkv_row_order: str = "tp4_chunks",
                     parallel: ParallelContext | None = None) -> dict[str, Placement | None]:
    """Every tensor name a checkpoint of ``config`` must hold, with its placement on this rank
    (``parallel``; default one process): None for a tensor another rank holds (other experts)."""
    ctx = parallel or ParallelContext.single()
    v0, v1 = ctx.tp_range(config.vocab_size, "vocab_size")
    plan: dict[str, Placement | None] = {
        "model.embed_tokens.weight": Placement("model.embed_tokens.weight", rows=_rows(v0, v1, ctx)),
        "model.norm.weight": Placement("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = Placement("lm_head.weight", rows=_rows(v0, v1, ctx))
    e0, e1 = ctx.expert_range(config.num_experts) if "moe" in config.mlp_kinds else (0, 0)
    i0, i1 = ctx.moe_inter_range(config.moe_intermediate_size) if "moe" in config.mlp_kinds else (0, 0)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            plan[p + name] = Placement(p + name)
        _attention_plan(plan, p, config.attn_spec(i), config.layer_kinds[i], config, qkv_row_order, ctx)
        if config.mlp_kinds[i] == "dense":
            d0, d1 = ctx.tp_range(config.intermediate_size, "intermediate_size")
            for name in ("gate_proj", "up_proj"):
                plan[f"{p}mlp.{name}.weight"] = Placement(f"{p}mlp.{name}.weight", rows=_rows(d0, d1, ctx))
            down = f"{p}mlp.down_proj.weight"
            plan[down] = Placement(down, cols=None if ctx.tp_size == 1 else (d0, d1))
            continue
        plan[p + "mlp.gate.weight"] = Placement(p + "mlp.gate.weight")
        plan[p + "mlp.gate.e_score_correction_bias"] = Placement(p + "mlp.gate.e_score_correction_bias")
        li = i1 - i0
        gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
        fp8 = config.expert_fp8_block
        sn = -(-li // fp8[0]) if fp8 else 0  # scale rows of the gate group (the up group's start after them)
        gu_scale, down_scale = (p + "mlp.experts.gate_up_scale_inv", p + "mlp.experts.down_scale_inv") if fp8 else (None, None)
        for e in range(config.num_experts):
            names = [f"{p}mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
            if not e0 <= e < e1:
                plan.update(dict.fromkeys(names))  # expected in the checkpoint, read by another rank
                continue
            k = e - e0
            plan[names[0]] = Placement(gate_up, (k, slice(0, li)), rows=_rows(i0, i1, ctx),
                                       scale_target=gu_scale, scale_index=(k, slice(0, sn)))
            plan[names[1]] = Placement(gate_up, (k, slice(li, 2 * li)), rows=_rows(i0, i1, ctx),
                                       scale_target=gu_scale, scale_index=(k, slice(sn, 2 * sn)))
            plan[names[2]] = Placement(down, (k,), cols=None if ctx.world_size == 1 else (i0, i1),
                                       scale_target=down_scale, scale_index=(k,))
    return plan


def expected_mtp_tensors(config: ModelConfig, num_layers: int, qkv_row_order: str = "tp4_chunks",
                         parallel: ParallelContext | None = None) -> dict[str, Placement]:
    """Every tensor of ``num_layers`` MTP layers (docs/model.md §2.2). Their attention is a sliding
    layer's, so its qkv (fused or split, FP8 or not) is read exactly like a main sliding layer's --
    under tensor parallelism this rank's heads -- and their dense MLP like a main dense layer's; the
    split spelling (``q_proj`` / ``k_proj`` / ``v_proj``) is what an HF-layout checkpoint would use
    (transformers' mimo_v2_flash defines no MTP of its own)."""
    ctx = parallel or ParallelContext.single()
    plan: dict[str, Placement] = {}
    if num_layers == 0:  # no MTP: intermediate_size need not split (a model without dense layers)
        return plan
    spec = sliding_layer_config(config).attn_spec(0)
    d0, d1 = ctx.tp_range(config.intermediate_size, "intermediate_size")
    for j in range(num_layers):
        p = f"{MTP_PREFIX}{j}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
                     "pre_mlp_layernorm.weight", "final_layernorm.weight"):
            plan[p + name] = Placement(p + name)
        for name in ("gate_proj", "up_proj"):
            plan[f"{p}mlp.{name}.weight"] = Placement(f"{p}mlp.{name}.weight", rows=_rows(d0, d1, ctx))
        plan[f"{p}mlp.down_proj.weight"] = Placement(f"{p}mlp.down_proj.weight",
                                                     cols=None if ctx.tp_size == 1 else (d0, d1))
        _attention_plan(plan, p, spec, "sliding", config, qkv_row_order, ctx)
    return plan


class MissingWeightsError(FileNotFoundError):
    """A checkpoint directory without weight files (``*.safetensors``)."""


class ShardReader:
    """All ``*.safetensors`` files of a directory as one lazy name -> tensor mapping (mmap)."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise MissingWeightsError(f"no *.safetensors files in {model_dir}")
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

    def handle(self, name: str):
        """The open safetensors file holding ``name`` (for partial reads through ``get_slice``)."""
        return self._file_of[name]

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
    """This rank's part of the checkpoint tensor in our row order, dequantised when it carries a
    weight_scale_inv; only that part is read from disk."""
    scale_name = name + SCALE_SUFFIX
    has_scale = scale_name in reader
    if has_scale and config.fp8 is None:
        raise ValueError(f"{scale_name} present but config.json has no fp8 quantization_config")
    if place.rows is None and place.cols is None and not has_scale:
        t = reader.get(name)
        if t.dtype == FP8_DTYPE:
            raise ValueError(f"{name} is FP8 but the checkpoint has no {scale_name}")
        return t
    return read_slice(reader.handle(name), name, place.rows, place.cols,
                      reader.handle(scale_name) if has_scale else None,
                      config.fp8.block_size if has_scale else None, place.quant_chunks)


def _read_kept_fp8(reader: ShardReader, name: str, place: Placement,
                   config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight kept in block-FP8: (values, block factors) as the checkpoint stores them when
    it is FP8 in the same blocks and this rank's slice starts on a block edge; otherwise (a float
    checkpoint, a slice that cuts blocks) read as floats and quantised here, on this rank's slice."""
    block = config.expert_fp8_block
    if config.fp8 is not None and config.fp8.block_size == block and name + SCALE_SUFFIX in reader:
        rows = None if place.rows is None else (int(place.rows[0]), int(place.rows[-1]) + 1)
        raw = read_fp8_blocks(reader.handle(name), name, rows, place.cols, reader.handle(name + SCALE_SUFFIX), block)
        if raw is not None:
            return raw
    q = BlockFP8.quantize(_read(reader, name, place, config).float(), block)
    return q.values, q.scale_inv


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    qkv_row_order: str = "tp4_chunks",
    ignore_prefixes: tuple[str, ...] = IGNORED_PREFIXES,
    parallel: ParallelContext | None = None,
    load_mtp: bool = True,
    fp8_experts: bool | None = False,
) -> MiMoV2ForCausalLM:
    """Build the model from ``model_dir/config.json`` and load its safetensors weights.

    ``qkv_row_order`` reads a fused hub ``qkv_proj`` as ``"tp4_chunks"`` (sglang) or ``"kv_groups"``
    (vLLM); see llm_core/model/layers/fused_qkv.py. It does not matter for split q/k/v checkpoints.
    Tensor names starting with ``ignore_prefixes`` (vision, audio parts) are skipped. MTP layers
    (``model.mtp.layers.{j}.*``) are loaded into ``model.model.mtp`` when present (``load_mtp=False``
    skips them); llm_core/engine/speculative/ drafts with them.
    ``parallel``: build and read only this rank's share (tensor / expert parallelism; default: all).
    Under tensor parallelism the MTP layers are sharded like a sliding layer (their heads, their MLP
    slice); the speculative draft and extend are mirrored to every rank (step_mirror.py).
    ``fp8_experts``: keep the routed experts as block-FP8 values and block factors (the checkpoint's
    when it is FP8, else quantised at load in 128 x 128 blocks) instead of in ``dtype``; None: when
    the checkpoint is FP8 and ``device`` is a GPU whose Triton kernels read e4m3 (sm_89+; on CPU the
    stacks would be dequantised per call). True on an older GPU is a ValueError naming it.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    reads_e4m3 = gpu_reads_e4m3(device)
    if fp8_experts is None:
        fp8_experts = config.fp8 is not None and bool(reads_e4m3)
    elif fp8_experts and reads_e4m3 is False:
        raise ValueError(f"fp8_experts needs a GPU of compute capability 8.9 or newer (Ada, Hopper) to read e4m3 "
                         f"weights; {device} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}: "
                         f"leave it off (the experts are then dequantised at load)")
    if fp8_experts and "moe" in config.mlp_kinds:
        config = replace(config, expert_fp8_block=config.fp8.block_size if config.fp8 else DEFAULT_FP8_BLOCK)
    plan = expected_tensors(config, qkv_row_order, parallel)
    with ShardReader(model_dir) as reader:
        present = {n for n in reader.names() if not n.startswith(ignore_prefixes)}
        num_mtp = mtp_layer_count(present) if load_mtp else 0
        if not load_mtp:
            present = {n for n in present if not n.startswith(MTP_PREFIX)}
        plan |= expected_mtp_tensors(config, num_mtp, qkv_row_order, parallel)
        _check_names(plan, present, config)
        with torch.device("meta"):
            model = MiMoV2ForCausalLM(config, parallel)
            if num_mtp:
                model.model.mtp = MTPHead(config, num_mtp, parallel)
        model.cast_(dtype)
        model.to_empty(device=device)
        model.tie_weights_()  # to_empty() gives tied parameters separate storage again
        targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        with torch.no_grad():
            for name, place in plan.items():
                if place is None:
                    continue
                if place.scale_target is not None:
                    values, scale = _read_kept_fp8(reader, name, place, config)
                    _place(targets, place.target, place.index, values, name)
                    _place(targets, place.scale_target, place.scale_index, scale, name + SCALE_SUFFIX)
                    continue
                _place(targets, place.target, place.index, _read(reader, name, place, config), name)
    return model.eval()


def _place(targets: dict[str, torch.Tensor], target: str, index: tuple, tensor: torch.Tensor, name: str) -> None:
    dest = targets[target].data[index]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint, expected {tuple(dest.shape)}")
    dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))
