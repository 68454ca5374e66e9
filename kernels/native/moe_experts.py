"""Wrapper of ``moe_experts.c``: the MoE experts of one layer in one C call (fp32 CPU, kernel layout).

:func:`moe_experts` takes the arguments of :func:`kernels.moe_ref.experts_ref` and returns the same
values to fp32 rounding, or None when the C kernel cannot take the call (kernels off or not built,
not fp32, not CPU, weights not in :func:`kernels.cpu.moe.kernel_layout`, odd strides); the caller then
keeps its torch path. Expert ids outside [0, E) raise ValueError (the C code checks them before it
reads a weight).

:func:`moe_route_experts` does the router of :func:`kernels.moe_ref.route_ref` in the same call
before the experts (one call per MoE layer instead of the router's ~8 dispatches plus the experts'):
the same checks and fallback, and None too when a token's choice is ambiguous (a tie at the k-th
place: torch's topk breaks ties its own way, so the caller routes that step in torch).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.native.build import openmp_flags

_NAME = "moe_experts"
# FMA in the tiles (one rounding per k, like MKL's kernels); the combine is written as two loops so
# its multiply and add stay two roundings, like torch's ``y * w`` then ``index_add_``.
_FLAGS = ("-ffp-contract=fast",)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"moe_experts_f32": ([_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr], ctypes.c_int),
               "moe_route_experts_f32": ([_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, ctypes.c_int,
                                          ctypes.c_float, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], ctypes.c_int)}


def _lib() -> ctypes.CDLL | None:
    return native.library(_NAME, flags=_FLAGS + openmp_flags(), signatures=_SIGNATURES)


def available() -> bool:
    """Whether the C kernel is on and built on this machine (builds it on first use)."""
    return _lib() is not None


def _column_major(w: torch.Tensor) -> bool:
    """[E, N, K] stored as each expert's W^T [K, N] row-major, the experts back to back."""
    return w.transpose(1, 2).is_contiguous()


def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """Sum_k w_k * down_e(silu(gate_e x) * up_e x) -> [T, H] fp32, or None (see the module docstring).

    x [T, H]; w_gate_up [E, 2I, H] and w_down [E, H, I] in kernel layout; topk_weights [T, k] fp32;
    topk_ids [T, k] int64."""
    tensors = (x, w_gate_up, w_down, topk_weights)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors) or topk_ids.dtype != torch.int64:
        return None
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or topk_ids.dim() != 2:
        return None
    (tokens, hidden), (experts, _, _), top_k = x.shape, w_gate_up.shape, topk_ids.shape[1]
    inter = w_down.shape[2]
    if (w_gate_up.shape != (experts, 2 * inter, hidden) or w_down.shape != (experts, hidden, inter)
            or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"experts: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
                         f"{tuple(w_down.shape)}, topk {tuple(topk_weights.shape)} / {tuple(topk_ids.shape)} "
                         "do not fit together")
    if not (_column_major(w_gate_up) and _column_major(w_down)):
        return None
    lib = _lib()
    if lib is None:
        return None
    x, topk_weights, topk_ids = x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    rc = lib.moe_experts_f32(x.data_ptr(), tokens, hidden, inter, experts, top_k, w_gate_up.data_ptr(),
                             w_down.data_ptr(), topk_weights.data_ptr(), topk_ids.data_ptr(), out.data_ptr())
    if rc == -1:
        raise ValueError(f"an expert id lies outside [0, {experts})")
    if rc:
        raise MemoryError(f"moe_experts: no memory for the work buffers of {tokens} x {top_k} rows")
    return out


def moe_route_experts(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int, n_group: int = 1,
                      topk_group: int = 1, renormalize: bool = True,
                      routed_scaling_factor: float = 1.0, residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """route_ref(x W_g^T, ...) then :func:`moe_experts` -> [T, H] fp32 (plus ``residual`` [T, H] when
    given: the decoder layer's residual add in the same call), or None (module docstring).
    router_weight [E, H] row-major fp32; correction_bias [E] fp32 or None."""
    tensors = (x, router_weight, w_gate_up, w_down) + tuple(t for t in (correction_bias, residual) if t is not None)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or router_weight.dim() != 2:
        return None
    (tokens, hidden), experts, inter = x.shape, w_gate_up.shape[0], w_down.shape[2]
    if (router_weight.shape != (experts, hidden) or w_gate_up.shape != (experts, 2 * inter, hidden)
            or w_down.shape != (experts, hidden, inter) or not 0 < top_k <= experts or n_group < 1
            or experts % n_group or not 0 < topk_group <= n_group or top_k > topk_group * (experts // n_group)
            or (correction_bias is not None and correction_bias.shape != (experts,))):
        return None
    if not (_column_major(w_gate_up) and _column_major(w_down) and router_weight.is_contiguous()
            and x.is_contiguous() and (correction_bias is None or correction_bias.is_contiguous())
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    rc = lib.moe_route_experts_f32(
        x.data_ptr(), tokens, hidden, inter, experts, top_k, router_weight.data_ptr(),
        None if correction_bias is None else correction_bias.data_ptr(), n_group, topk_group, int(renormalize),
        routed_scaling_factor, w_gate_up.data_ptr(), w_down.data_ptr(), weights.data_ptr(), ids.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr())
    if rc == 1:
        return None
    if rc:
        raise MemoryError(f"moe_route_experts: no memory for the work buffers of {tokens} x {top_k} rows")
    return out
