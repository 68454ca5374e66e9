"""MoE expert computation without Triton: one grouped matmul per projection over all experts.

Same math as :func:`kernels.moe_ref.experts_ref`. The reference loops over experts in Python (~13
small ops each); in a decode step each expert sees a handful of tokens, so that loop, not the math,
is the cost. Here the (token, k) assignments are sorted by expert once and both projections run as
a single ``torch.nn.functional.grouped_mm`` over the jagged groups:

    sorted rows:  | e0: t3 t7 | e1: t0 | e2: (none) | e3: t1 t3 t5 | ...
    offs       :          2        3            3             6   ...   (end of each group)
    gate_up = grouped_mm(x[token_of], W_gate_up^T, offs)  -> silu(gate) * up
    y       = grouped_mm(hidden,      W_down^T,    offs)  -> * weight -> index_add_ to its token

grouped_mm needs 16-byte aligned rows and storage; when a shape or buffer does not allow it (or
torch lacks the op) the reference runs instead. The model keeps its stacked expert weights in
:func:`kernel_layout` on CPU (column-major per expert), so both GEMMs read a contiguous operand.

A single token (decode at batch 1) skips the sort and the grouping: its k experts run as plain
matmuls on views of the stacked weights, summed in ascending expert order like the reference, so
the result is the reference's bit for bit.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.moe_ref import experts_ref

_GROUPED_MM = getattr(F, "grouped_mm", None)


def _aligned(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16 or (t.shape[-2] * t.element_size()) % 16:
            return False
    return True


def experts_cpu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Sum_k w_k * down_e(silu(gate_e x) * up_e x) -> [T, H] (x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I])."""
    if x.shape[0] == 1 and topk_ids.numel():
        return _one_token(x, w_gate_up, w_down, topk_weights, topk_ids)
    if (_GROUPED_MM is None or topk_ids.numel() == 0 or x.dtype != w_gate_up.dtype
            or not _aligned(x, w_gate_up, w_down)):
        return experts_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // topk_ids.shape[1]
    offs = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    # one gather of the token rows in expert order, two grouped GEMMs, one weighted scatter-add
    gate_up = _GROUPED_MM(x[token_of], w_gate_up.transpose(1, 2), offs=offs)
    hidden = F.silu(gate_up[:, :inter])
    hidden.mul_(gate_up[:, inter:])  # in place on silu's fresh buffer: one [R, I] tensor, not three
    y = _GROUPED_MM(hidden, w_down.transpose(1, 2), offs=offs).float()
    y.mul_(topk_weights.reshape(-1)[order, None].float())
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y)
    return out.to(x.dtype)


def kernel_layout(w: torch.Tensor) -> torch.Tensor:
    """Stacked expert weights [E, N, K] stored column-major per expert (same shape and values), so
    the grouped GEMM reads ``w.transpose(1, 2)`` [E, K, N] as a plain contiguous operand instead of
    a strided view: MKL streams it once, the memory-bound part of a decode step's experts (a no-op
    for weights already in this layout)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def _one_token(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    inter = w_down.shape[2]
    ids = topk_ids[0].tolist()
    out = None
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        gate_up = F.linear(x, w_gate_up[ids[j]])
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down[ids[j]])
        y = y.float() * topk_weights[:, j : j + 1].float()
        out = y if out is None else out + y
    return out.to(x.dtype)
