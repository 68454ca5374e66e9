"""Wrapper of ``decoder_layer.c``: the glue of a decoder layer around its attention for the few rows
of a decode step, two C calls per layer (fp32 CPU, the projection weights in kernel layout).

:func:`attention_front` (RMSNorm -> QKV projection -> RoPE -> value scale -> KV store) returns the projection [T, N] (q and k rotated, v scaled; k and v also written
into the pool at ``slots``), or None when the C kernel cannot take the call (kernels off or not built,
not fp32, not CPU, the weight not column-major, odd strides); the caller then keeps its torch path
(:meth:`llm_core.model.layers.attention.Attention.write_kv`). A slot at or past the pool's end raises
ValueError before anything is written, as the torch path's ``index_copy_`` raises.

:func:`attention_out` (o_proj -> residual add -> post-attention RMSNorm) returns (x + o_proj(attn),
the norm of that), or None likewise; :func:`dense_mlp` (a dense layer's SwiGLU MLP plus the residual)
the MLP's output, or None.

Past ``MAX_ROWS`` rows (a prefill step) MKL runs the projections and two calls do the per-row glue between
them: :func:`rope_store` (RoPE, value scale, KV store on the projection, in place) and
:func:`add_rms_norm` (the residual add and the RMSNorm), each None where it cannot take the call.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native.build import library, openmp_flags

# Rows up to which the model sends a step to these calls (llm_core/model/layers: attention, mlp): the
# register-tiled projections match MKL at 32 rows and save ~20 dispatches per layer; past a few dozen
# rows a prefill chunk is compute, MKL's domain.
MAX_ROWS = 64

_NAME = "decoder_layer"
_FLAGS = ("-ffp-contract=fast",)  # FMA in the projection, like the experts kernel
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {"attention_front_f32": ([_ptr, _i64, _i64, _ptr, _f32, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr,
                                        _ptr, _f32, _ptr, _ptr, _i64, _ptr, _ptr], ctypes.c_int),
               "attention_out_f32": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _f32, _ptr, _ptr], ctypes.c_int),
               "dense_mlp_f32": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr], ctypes.c_int),
               "rope_store_f32": ([_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32, _ptr, _ptr,
                                   _i64, _ptr], ctypes.c_int),
               "add_rms_norm_f32": ([_ptr, _ptr, _i64, _i64, _ptr, _f32, _ptr, _ptr], None)}


def _lib() -> ctypes.CDLL | None:
    # OpenMP where torch's runtime is loaded: rope_store / add_rms_norm split a long step's rows
    # among the calling thread's team (the engine thread's wide step; serial at one thread)
    return library(_NAME, flags=_FLAGS + openmp_flags(), signatures=_SIGNATURES)


def available() -> bool:
    """Whether the C kernel is on and built on this machine (builds it on first use)."""
    return _lib() is not None


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu for t in tensors)


def attention_front(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, w_qkv: torch.Tensor, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, cos: torch.Tensor,
                    signed_sin: torch.Tensor, value_scale: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor | None:
    """x [T, H]; norm_weight [H] (None: x is already normalised); w_qkv [N, H] column-major with
    N = (num_heads + num_kv_heads) * head_dim + num_kv_heads * v_head_dim; cos / signed_sin [T, 1, R]
    (``PartialRotary.tables``); k_cache [S, Hkv, head_dim], v_cache [S, Hkv, v_head_dim]; slots [T]
    int64 (< 0: not stored). Returns the projection [T, N] or None (see the module docstring)."""
    tensors = (x, w_qkv, cos, signed_sin, k_cache, v_cache) + (() if norm_weight is None else (norm_weight,))
    if not _f32_cpu(*tensors) or slots.dtype is not torch.int64 or not slots.is_cpu:
        return None
    if x.dim() != 2 or w_qkv.dim() != 2 or k_cache.dim() != 3 or v_cache.dim() != 3 or cos.dim() != 3:
        return None
    (t, hidden), rot = x.shape, cos.shape[-1]
    n = (num_heads + num_kv_heads) * head_dim + num_kv_heads * v_head_dim
    if (w_qkv.shape != (n, hidden) or cos.shape != (t, 1, rot) or signed_sin.shape != cos.shape or rot > head_dim
            or rot % 2 or slots.shape != (t,) or k_cache.shape[1:] != (num_kv_heads, head_dim)
            or v_cache.shape != (k_cache.shape[0], num_kv_heads, v_head_dim)
            or (norm_weight is not None and norm_weight.shape != (hidden,))):
        return None
    if not (w_qkv.t().is_contiguous() and x.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty(t, n, dtype=torch.float32)
    rc = lib.attention_front_f32(
        x.data_ptr(), t, hidden, None if norm_weight is None else norm_weight.data_ptr(), eps, w_qkv.data_ptr(),
        num_heads, num_kv_heads, head_dim, v_head_dim, rot, cos.data_ptr(), signed_sin.data_ptr(), value_scale,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], slots.data_ptr(), out.data_ptr())
    if rc == -1:
        raise ValueError(f"a KV slot lies outside the pool of {k_cache.shape[0]} slots")
    if rc:
        raise MemoryError(f"attention_front: no memory for the normalised rows of {t} x {hidden}")
    return out


def attention_out(attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """attn [T, A]; w_o [H, A] column-major; x [T, H] (the residual stream); norm_weight [H] ->
    (x + attn w_o^T, RMSNorm of it), both [T, H], or None when the C kernel cannot take the call."""
    if not _f32_cpu(attn, w_o, x, norm_weight) or attn.dim() != 2 or x.dim() != 2:
        return None
    (t, a), hidden = attn.shape, x.shape[1]
    if w_o.shape != (hidden, a) or x.shape[0] != t or norm_weight.shape != (hidden,):
        return None
    if not (w_o.t().is_contiguous() and attn.is_contiguous() and x.is_contiguous()):
        return None
    lib = _lib()
    if lib is None:
        return None
    x_out, h = torch.empty(t, hidden), torch.empty(t, hidden)
    if lib.attention_out_f32(attn.data_ptr(), t, a, w_o.data_ptr(), x.data_ptr(), hidden, norm_weight.data_ptr(),
                             eps, x_out.data_ptr(), h.data_ptr()):
        raise MemoryError(f"attention_out: no memory for the transposed rows of {t} x {a}")
    return x_out, h


def dense_mlp(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """h [T, H]; w_gate / w_up [I, H] and w_down [H, I] column-major -> down(silu(gate h) * up h)
    (+ residual [T, H]) [T, H], or None when the C kernel cannot take the call."""
    tensors = (h, w_gate, w_up, w_down) + (() if residual is None else (residual,))
    if not _f32_cpu(*tensors) or h.dim() != 2 or w_gate.dim() != 2:
        return None
    (t, hidden), inter = h.shape, w_gate.shape[0]
    if (w_gate.shape != (inter, hidden) or w_up.shape != w_gate.shape or w_down.shape != (hidden, inter)
            or (residual is not None and residual.shape != h.shape)):
        return None
    if not (h.is_contiguous() and all(w.t().is_contiguous() for w in (w_gate, w_up, w_down))
            and (residual is None or residual.is_contiguous())):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty(t, hidden)
    if lib.dense_mlp_f32(h.data_ptr(), t, hidden, inter, w_gate.data_ptr(), w_up.data_ptr(), w_down.data_ptr(),
                         None if residual is None else residual.data_ptr(), out.data_ptr()):
        raise MemoryError(f"dense_mlp: no memory for the intermediate rows of {t} x {inter}")
    return out


def rope_store(qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
               cos: torch.Tensor, signed_sin: torch.Tensor, value_scale: float, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """The rest of :func:`attention_front` after its projection, on a projection [T, N] torch computed
    (rows of stride >= N, unit column stride): q and k rotated and v scaled in place, k and v stored at
    ``slots``. False (nothing done) when the C kernel cannot take the call; raises ValueError for a slot
    past the pool before anything is written."""
    if not _f32_cpu(qkv, cos, signed_sin, k_cache, v_cache) or slots.dtype is not torch.int64 or not slots.is_cpu:
        return False
    if qkv.dim() != 2 or k_cache.dim() != 3 or v_cache.dim() != 3 or cos.dim() != 3:
        return False
    t, rot = qkv.shape[0], cos.shape[-1]
    n = (num_heads + num_kv_heads) * head_dim + num_kv_heads * v_head_dim
    if (qkv.shape[1] != n or qkv.stride(1) != 1 or qkv.stride(0) < n or cos.shape != (t, 1, rot)
            or signed_sin.shape != cos.shape or rot > head_dim or rot % 2 or slots.shape != (t,)
            or k_cache.shape[1:] != (num_kv_heads, head_dim)
            or v_cache.shape != (k_cache.shape[0], num_kv_heads, v_head_dim)):
        return False
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slots.is_contiguous()):
        return False
    lib = _lib()
    if lib is None:
        return False
    if lib.rope_store_f32(qkv.data_ptr(), t, qkv.stride(0), num_heads, num_kv_heads, head_dim, v_head_dim, rot,
                          cos.data_ptr(), signed_sin.data_ptr(), value_scale, k_cache.data_ptr(), v_cache.data_ptr(),
                          k_cache.shape[0], slots.data_ptr()):
        raise ValueError(f"a KV slot lies outside the pool of {k_cache.shape[0]} slots")
    return True


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [T, H], delta [T, H] or None, norm_weight [H] -> (x + delta, RMSNorm of it * weight); without
    delta (x, the norm of x). None when the C kernel cannot take the call."""
    tensors = (x, norm_weight) + (() if delta is None else (delta,))
    if not _f32_cpu(*tensors) or x.dim() != 2 or norm_weight.shape != (x.shape[1],):
        return None
    if not (x.is_contiguous() and norm_weight.is_contiguous()) or (
            delta is not None and (delta.shape != x.shape or not delta.is_contiguous())):
        return None
    lib = _lib()
    if lib is None:
        return None
    total = x if delta is None else torch.empty_like(x)
    h = torch.empty_like(x)
    lib.add_rms_norm_f32(x.data_ptr(), None if delta is None else delta.data_ptr(), x.shape[0], x.shape[1],
                         norm_weight.data_ptr(), eps, total.data_ptr(), h.data_ptr())
    return total, h
