"""MoE expert computation without Triton: one grouped matmul per projection over all experts.

Same math as :func:`kernels.moe_ref.experts_ref`. The reference loops over experts in Python (~13
small ops each); in a decode step each expert sees a handful of tokens, so that loop, not the math,
is the cost. Here the (token, k) assignments are sorted by expert once and both projections run as
a single ``torch.nn.functional.grouped_mm`` over the jagged groups:

    sorted rows:  | e0: t3 t7 | e1: t0 | e2: (none) | e3: t1 t3 t5 | ...
    offs       :          2        3            3             6   ...   (end of each group)
    gate_up = grouped_mm(x[token_of], W_gate_up^T, offs)  -> silu(gate) * up
    y       = grouped_mm(hidden,      W_down^T,    offs)  -> * weight -> index_add_ to its token

Why not one ``bmm`` over experts padded to the busiest expert's rows (one GEMM call per projection
instead of one per expert): at decode batch 32 (64 assignments over 16 experts, mean 4 rows, max ~8)
it reads the same weights but computes twice the rows, and in a real step it was ~30% slower per
layer than the grouped GEMMs (measured in the engine, README "Where a text step's time goes").

grouped_mm needs 16-byte aligned rows and storage; when a shape or buffer does not allow it (or
torch lacks the op) the reference runs instead. The model keeps its stacked expert weights in
:func:`kernel_layout` on CPU (column-major per expert), so both GEMMs read a contiguous operand.

A single token (decode at batch 1) skips the sort and the grouping: its k experts run as plain
matmuls on views of the stacked weights, summed in ascending expert order like the reference, so
the result is the reference's bit for bit.

A handful of rows (up to ``SMALL_M``: an MTP verify step's 1 + k rows, a small decode batch) runs
*dense* when that is cheap in bytes: every row through every expert in one broadcast matmul per
projection, the unchosen (row, expert) pairs weighted by zero:

    gate_up [E, T, 2I] = x [T, H] @ W_gate_up^T        (x broadcast over the experts)
    y       [E, T, H]  = (silu(gate) * up) @ W_down^T
    out     [T, H]     = sum_e  y[e] * w[:, e]          w [T, E]: topk weights scattered, else 0

It saves the sort, the gathers and the scatter (~25 dispatches -> ~12), the cost of a small step on
a small model, but reads the weights of experts no row chose. So it runs only while those idle
experts' weights stay under ``DENSE_IDLE_BYTES`` (1 MiB streams in about the 0.1 ms the saved
dispatches cost): always for a small model, never for MiMo-V2.5's 256 large experts.
The values equal the reference's to fp32 rounding, not bit for bit (MKL rounds a row differently
when M differs).

Before all of these, fp32 weights in :func:`kernel_layout` go to the C kernel
(:mod:`kernels.native.moe_experts`: one call per layer, each chosen expert's weights read once front
to back, register tiles once an expert has a few rows; on a wide thread -- the engine thread's team
during a long step -- the experts' rows split among the team) for any step whose (token, expert) rows
hold at most ``NATIVE_MAX_BYTES`` of activations. It was first limited to a few rows per expert, where
it streams the weights better than MKL; with the register tiles it computes faster than grouped_mm at
every size measured (benchmarks/moe_experts.py, one thread: 1.9-3.5x from 1 to 512 tokens on the demo
shape, 1.5x at 64 and 256 rows per expert on H 1024), and it also saves the sort, the gathers and the
scatter. Past the byte cap (a long prefill chunk of a MiMo-sized model, whose rows' outputs the kernel
holds until its combine) and when it returns None (kernels off, no compiler, bf16) the torch paths
below serve.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.moe_ref import experts_ref
from kernels.native.moe_experts import moe_experts

_GROUPED_MM = getattr(F, "grouped_mm", None)
# Bytes of (token, expert) rows' activations (rows x hidden x 4) up to which the C kernel serves: a
# whole 8192-token chunk of a hidden-256 model at top-2 is 16 MiB; MiMo-V2.5 (hidden 4096, top-8) stays
# on it up to 512 tokens a step.
NATIVE_MAX_BYTES = 64 << 20

SMALL_M = 8  # up to this many rows a batch may run dense ...
DENSE_IDLE_BYTES = 1 << 20  # ... when the weights of the experts no row chose are at most this


def native_serves(tokens: int, top_k: int, hidden: int) -> bool:
    """Whether the C experts kernel takes ``tokens`` x ``top_k`` (token, expert) rows of width
    ``hidden`` (the one rule experts_cpu, SparseMoE and the one-call decode layer share)."""
    rows = tokens * top_k
    return 0 < rows and rows * hidden * 4 <= NATIVE_MAX_BYTES


def _aligned(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether grouped_mm takes these operands: 16-byte aligned rows. The weights go in transposed,
    so both of their dimensions count; the activations go in as a fresh gathered copy ``x[order]``,
    so only their row width does (an odd token count must not send a step to the per-expert loop)."""
    if (x.shape[-1] * x.element_size()) % 16:
        return False
    for t in weights:
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
    if topk_ids.dim() == 2 and native_serves(topk_ids.shape[0], topk_ids.shape[1], x.shape[-1]):
        out = moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
        if out is not None:
            return out
    if x.shape[0] == 1 and topk_ids.numel():
        return _one_token(x, w_gate_up, w_down, topk_weights, topk_ids)
    if x.dtype == w_gate_up.dtype and _dense_pays(topk_ids, w_gate_up, w_down):
        return _dense(x, w_gate_up, w_down, topk_weights, topk_ids)
    if (_GROUPED_MM is None or topk_ids.numel() == 0 or x.dtype != w_gate_up.dtype
            or not _aligned(x, w_gate_up, w_down)):
        return experts_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // topk_ids.shape[1]
    offs = torch.bincount(flat, minlength=num_experts).cumsum(0, dtype=torch.int32)
    # one gather of the token rows in expert order, two grouped GEMMs, one weighted scatter-add.
    # Every op here costs ~10 us of dispatch in a decode step whatever its size (caches cold after
    # the weight streaming), so conversions that would be no-ops in fp32 are skipped, not called.
    gate_up = _GROUPED_MM(x.index_select(0, token_of), w_gate_up.transpose(1, 2), offs=offs)
    hidden = F.silu(gate_up[:, :inter])
    hidden.mul_(gate_up[:, inter:])  # in place on silu's fresh buffer: one [R, I] tensor, not three
    y = _fp32(_GROUPED_MM(hidden, w_down.transpose(1, 2), offs=offs))
    y.mul_(_fp32(topk_weights.reshape(-1).index_select(0, order))[:, None])
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token_of, y)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def experts_cpu_kept(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """``experts_cpu`` of the entries whose id is below E; the others (id E: another rank's expert
    under expert parallelism) contribute nothing. They are dropped by a host-side select first: on a
    CPU that read costs no device sync, and the kernels then see only this rank's rows."""
    flat = topk_ids.reshape(-1)
    rows = (flat < w_gate_up.shape[0]).nonzero().squeeze(1)
    out = torch.zeros_like(x)
    if rows.numel() == 0:
        return out
    token_of = rows // topk_ids.shape[1]
    y = experts_cpu(x[token_of], w_gate_up, w_down, topk_weights.reshape(-1)[rows, None], flat[rows, None])
    return out.index_add_(0, token_of, y.to(x.dtype))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


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


def _dense_pays(topk_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether a small batch (2..SMALL_M rows) leaves at most DENSE_IDLE_BYTES of expert weights idle."""
    rows, k = topk_ids.shape
    if not 1 < rows <= SMALL_M:
        return False
    num_experts = w_gate_up.shape[0]
    (_, n1, k1), (_, n2, k2) = w_gate_up.shape, w_down.shape
    per_expert = (n1 * k1 + n2 * k2) * w_gate_up.element_size()
    idle_allowed = DENSE_IDLE_BYTES // per_expert
    if num_experts <= idle_allowed:  # even all experts idle fit: no need to look at the choice
        return True
    if rows * k < num_experts - idle_allowed:  # too few choices to leave few enough idle
        return False
    used = len(set(topk_ids.reshape(-1).tolist()))  # one host read of a few ids
    return num_experts - used <= idle_allowed


def _dense(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    inter = w_down.shape[2]
    gate_up = torch.matmul(x, w_gate_up.transpose(1, 2))  # [E, T, 2I]
    hidden = F.silu(gate_up[..., :inter])
    hidden.mul_(gate_up[..., inter:])
    y = torch.bmm(hidden, w_down.transpose(1, 2))  # [E, T, H]
    weight = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=torch.float32, device=x.device)
    weight.scatter_(1, topk_ids, topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float())
    if y.dtype == torch.float32:  # the weighted sum in fp32, like the reference
        return y.mul_(weight.T[:, :, None]).sum(0)
    return (y.float() * weight.T[:, :, None]).sum(0).to(x.dtype)
