"""Wrapper of ``moe_experts.c``: the MoE experts of one layer in one C call (fp32 CPU, kernel layout).

:func:`moe_experts` takes the arguments of :func:`kernels.moe_ref.experts_ref` and returns the same
values to fp32 rounding, or None when the C kernel cannot take the call (kernels off or not built,
not fp32, not CPU, weights not in :func:`kernels.moe_cpu.kernel_layout`, odd strides); the caller then
keeps its torch path. Expert ids outside [0, E) raise ValueError (the C code checks them before it
reads a weight).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native

_NAME = "moe_experts"
# FMA in the tiles (one rounding per k, like MKL's kernels); the combine is written as two loops so
# its multiply and add stay two roundings, like torch's ``y * w`` then ``index_add_``.
_FLAGS = ("-ffp-contract=fast",)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"moe_experts_f32": ([_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr], ctypes.c_int)}


def _lib() -> ctypes.CDLL | None:
    return native.library(_NAME, flags=_FLAGS, signatures=_SIGNATURES)


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
    (tokens, hidden), (experts, two_inter, _), top_k = x.shape, w_gate_up.shape, topk_ids.shape[1]
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
