"""Wrapper of ``fused_layer.c``: a whole decoder layer of an all-decode step in one C call.

The call chains the kernels the layer's own wrappers call one by one (``decoder_layer.attention_front``,
``paged_decode.decode_attention``, ``decoder_layer.attention_out``, ``moe_experts.moe_route_experts`` /
``decoder_layer.dense_mlp``), through the addresses of those kernels' built libraries: the same
machine code on the same inputs, so the same bits. What it saves is the Python between them.

:func:`layer_constants` checks a layer's weights once (the layouts those wrappers check per call)
and packs their pointers; :func:`step_metadata` packs a step's decode metadata once per pool;
:func:`decode_layer` checks the per-call tensors and runs the layer. Each returns None where one of
the chained wrappers would have returned None, so the caller keeps today's per-kernel path exactly
there.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.native import decoder_layer, moe_experts, paged_decode
from kernels.native.build import library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"decode_layer_f32": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr], ctypes.c_int)}

# Field order of the ``layer`` / ``f`` / ``step`` arrays: the enums of fused_layer.c.
_LAYER = ("front attn out mlp moe h hq hkv d dv r norm_in wqkv sinks wo norm_post i e k w1 w2 w3 bias ngroup "
          "topkgroup renorm").split()
_STEP = "t cos sin slots table table_cols lens reqs rows page window chunk_after at pick".split()
_F32 = torch.float32


def _lib() -> ctypes.CDLL | None:
    return library("fused_layer", signatures=_SIGNATURES)


def available() -> bool:
    """Whether the C kernel is on and built on this machine (builds it on first use)."""
    return _lib() is not None


def _address(lib: ctypes.CDLL | None, name: str) -> int | None:
    return None if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@dataclass(frozen=True)
class LayerConstants:
    """One layer's weights and shapes as fused_layer.c reads them. ``tensors`` keeps the pointed-to
    tensors alive; ``key`` (their data_ptr()s) tells the layer when its weights were replaced."""

    ints: ctypes.Array
    floats: ctypes.Array
    tensors: tuple[torch.Tensor, ...]
    key: tuple[int, ...]
    hidden: int
    num_heads: int


@dataclass(frozen=True)
class MoEWeights:
    router: torch.Tensor  # [E, H] fp32 row-major
    bias: torch.Tensor | None  # [E]
    gate_up: torch.Tensor  # [E, 2I, H] kernel layout
    down: torch.Tensor  # [E, H, I] kernel layout
    top_k: int
    n_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class DenseWeights:
    gate: torch.Tensor  # [I, H] column-major
    up: torch.Tensor
    down: torch.Tensor  # [H, I] column-major


def weight_key(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The data_ptr()s a LayerConstants was built from (a re-laid or cast weight gets new storage)."""
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def layer_constants(*, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                    rotary_dim: int, norm_in: torch.Tensor, eps_in: float, w_qkv: torch.Tensor, value_scale: float,
                    scale: float, sinks: torch.Tensor | None, w_o: torch.Tensor, norm_post: torch.Tensor,
                    eps_post: float, mlp: MoEWeights | DenseWeights, key: tuple[int, ...]) -> LayerConstants | None:
    """The layer's constants, or None when a weight is not in the layout the chained kernels read
    (their wrappers would return None: the caller keeps the per-kernel path)."""
    libs = (_lib(), decoder_layer._lib(), paged_decode._lib(), moe_experts._lib())
    if any(lib is None for lib in libs):
        return None
    n = (num_heads + num_kv_heads) * head_dim + num_kv_heads * v_head_dim
    a = num_heads * v_head_dim
    weights = [norm_in, w_qkv, w_o, norm_post] + [t for t in vars(mlp).values() if isinstance(t, torch.Tensor)]
    if sinks is not None:
        sinks = sinks.detach().contiguous()
        weights.append(sinks)
    if not all(t.dtype is _F32 and t.is_cpu for t in weights) or num_kv_heads == 0 or num_heads % num_kv_heads:
        return None
    if (w_qkv.shape != (n, hidden) or not w_qkv.t().is_contiguous() or w_o.shape != (hidden, a)
            or not w_o.t().is_contiguous() or norm_in.shape != (hidden,) or norm_post.shape != (hidden,)
            or rotary_dim > head_dim or rotary_dim % 2 or (sinks is not None and sinks.numel() != num_heads)):
        return None
    _, dl, pd, me = libs
    fields = dict(front=_address(dl, "attention_front_f32"), attn=_address(pd, "paged_decode_attention"),
                  out=_address(dl, "attention_out_f32"), h=hidden, hq=num_heads, hkv=num_kv_heads, d=head_dim,
                  dv=v_head_dim, r=rotary_dim, norm_in=norm_in.data_ptr(), wqkv=w_qkv.data_ptr(),
                  sinks=0 if sinks is None else sinks.data_ptr(), wo=w_o.data_ptr(), norm_post=norm_post.data_ptr())
    if isinstance(mlp, MoEWeights):
        e, inter = mlp.gate_up.shape[0], mlp.down.shape[-1]
        if (mlp.router.shape != (e, hidden) or not mlp.router.is_contiguous() or mlp.gate_up.shape != (e, 2 * inter, hidden)
                or mlp.down.shape != (e, hidden, inter) or not moe_experts._column_major(mlp.gate_up)
                or not moe_experts._column_major(mlp.down) or not 0 < mlp.top_k <= e or mlp.n_group < 1
                or e % mlp.n_group or not 0 < mlp.topk_group <= mlp.n_group
                or mlp.top_k > mlp.topk_group * (e // mlp.n_group)
                or (mlp.bias is not None and (mlp.bias.shape != (e,) or not mlp.bias.is_contiguous()))):
            return None
        fields.update(mlp=_address(me, "moe_route_experts_f32"), moe=1, i=inter, e=e, k=mlp.top_k,
                      w1=mlp.router.data_ptr(), w2=mlp.gate_up.data_ptr(), w3=mlp.down.data_ptr(),
                      bias=0 if mlp.bias is None else mlp.bias.data_ptr(), ngroup=mlp.n_group,
                      topkgroup=mlp.topk_group, renorm=int(mlp.renormalize))
        routed = mlp.routed_scaling_factor
    else:
        inter = mlp.gate.shape[0]
        if (mlp.gate.shape != (inter, hidden) or mlp.up.shape != mlp.gate.shape or mlp.down.shape != (hidden, inter)
                or not all(w.t().is_contiguous() for w in (mlp.gate, mlp.up, mlp.down))):
            return None
        fields.update(mlp=_address(dl, "dense_mlp_f32"), moe=0, i=inter, w1=mlp.gate.data_ptr(),
                      w2=mlp.up.data_ptr(), w3=mlp.down.data_ptr())
        routed = 1.0
    ints = (ctypes.c_int64 * len(_LAYER))(*(fields.get(name, 0) for name in _LAYER))
    floats = (ctypes.c_float * 5)(eps_in, value_scale, scale, eps_post, routed)
    return LayerConstants(ints, floats, tuple(weights), key, hidden, num_heads)


def step_metadata(decode: paged_decode.DecodeRows, cos: torch.Tensor, signed_sin: torch.Tensor,
                  slots: torch.Tensor, pick: torch.Tensor | None = None) -> ctypes.Array | None:
    """The step's decode metadata for one pool, or None when the rotary tables or slots are not what
    the C front reads. The tables must be those of the layers' rotary setup: the caller keys this on it.

    ``pick`` None: every row of the step is a decode row, in order (``decode`` covers them all).
    ``pick`` [R] int64: the layer's output is wanted for those rows of the step alone (a short
    prefill's logits rows, strictly increasing); the front (cos, sin, slots) covers all of the
    step's rows and ``decode`` the R picked rows as decode rows of their own (``logits_batch``).
    None too for a ``pick`` that is not such rows (the C call would read outside x): the torch path,
    which takes rows in any order, serves or raises."""
    t = cos.shape[0] if pick is not None else decode.num_tokens
    if (cos.dtype is not _F32 or signed_sin.dtype is not _F32 or not cos.is_cpu or cos.dim() != 3
            or cos.shape[:2] != (t, 1) or signed_sin.shape != cos.shape or not cos.is_contiguous()
            or not signed_sin.is_contiguous() or slots.dtype is not torch.int64 or not slots.is_cpu
            or slots.shape != (t,) or not slots.is_contiguous() or decode.rows.shape != (decode.num_tokens,)):
        return None
    picked = 0
    if pick is not None:
        if pick.dtype is not torch.int64 or not pick.is_cpu or pick.shape != (decode.num_tokens,) or not pick.is_contiguous():
            return None
        rows = pick.tolist()
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and not (0 <= rows[0] and rows[-1] < t)):
            return None
        picked = pick.data_ptr()
    table, lens, reqs, rows = decode.pointers
    values = dict(t=t, cos=cos.data_ptr(), sin=signed_sin.data_ptr(), slots=slots.data_ptr(), table=table,
                  table_cols=decode.table.shape[1], lens=lens, reqs=reqs, rows=rows, page=decode.page_size,
                  window=decode.window or 0, chunk_after=decode.chunk_after, at=decode.num_tokens, pick=picked)
    return (ctypes.c_int64 * len(_STEP))(*(values[name] for name in _STEP))


def decode_layer(consts: LayerConstants, step: ctypes.Array, x: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, decode: paged_decode.DecodeRows
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(x1, h, out) of the layer for x [T, H] (T: the step's rows, ``step_metadata``): x1 = x +
    attention, h = its post-attention norm, out = x1 + mlp(h), each [R, H] for the R rows of
    ``decode`` (all T, or the picked ones) — or out None when the router's choice is ambiguous (the
    caller routes h in torch, as SparseMoE does then). None when a tensor is not what the kernels
    read. Raises as the chained wrappers raise (a slot outside the pool, a released or out-of-pool
    page, no memory)."""
    t, r = step[0], decode.num_tokens  # step[0]: S_T, the front's rows
    if (x.dtype is not _F32 or not x.is_cpu or x.shape != (t, consts.hidden) or not x.is_contiguous()
            or k_cache.dtype is not _F32 or v_cache.dtype is not _F32 or not k_cache.is_cpu or not v_cache.is_cpu
            or k_cache.dim() != 3 or v_cache.dim() != 3 or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return None
    ints = consts.ints
    slots, hkv, d = k_cache.shape
    if hkv != ints[7] or d != ints[8] or v_cache.shape != (slots, hkv, ints[9]) or slots % decode.page_size:
        return None
    xho = torch.empty(3, r, consts.hidden)
    error = (ctypes.c_long * 2)()
    rc = _lib().decode_layer_f32(consts.ints, consts.floats, step, x.data_ptr(), k_cache.data_ptr(),
                                 v_cache.data_ptr(), slots, xho.data_ptr(), error)
    if rc == 0:
        return xho[0], xho[1], xho[2]
    if rc == 1:
        return xho[0], xho[1], None
    if rc == -1:
        raise ValueError(f"a KV slot lies outside the pool of {slots} slots")
    if rc > 10:
        paged_decode._raise(rc - 10, decode, int(error[0]), int(error[1]), slots)
    raise MemoryError(f"decode_layer: no memory for the work buffers of {t} rows")
