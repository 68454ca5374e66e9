"""Torch references for the MiMo/DeepSeek-style MoE: sigmoid router with correction-bias top-k, and
the expert computation (gate/up -> SiLU*mul -> down, weighted combine)."""

from __future__ import annotations

import torch


def route_ref(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts per token -> (topk_weights fp32 [T, k], topk_ids int64 [T, k]).

    The correction bias only decides *which* experts win; the weights are the unbiased sigmoid scores.
    With ``n_group > 1`` a token first keeps its ``topk_group`` best groups (group score = sum of the
    group's two best biased scores) and picks experts inside them.
    """
    scores = torch.sigmoid(router_logits if router_logits.dtype == torch.float32 else router_logits.float())
    if correction_bias is not None and correction_bias.dtype != torch.float32:
        correction_bias = correction_bias.float()
    choice = scores if correction_bias is None else scores + correction_bias
    num_tokens, num_experts = choice.shape
    if n_group > 1:
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if routed_scaling_factor == 1.0:  # x * 1.0 == x: skipping the multiply (a dispatch per layer) is exact
        return weights, topk_ids
    return weights * routed_scaling_factor, topk_ids


def experts_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Sum_k w_k * down_e(silu(gate_e x) * up_e x).

    x [T, H]; w_gate_up [E, 2I, H] (gate rows first, then up); w_down [E, H, I] -> [T, H].
    Tokens are grouped by expert so each expert runs one matmul over its tokens. An id equal to E
    (another rank's expert under expert parallelism) contributes nothing.
    """
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    inter = w_down.shape[2]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // topk_ids.shape[1]
    num_experts = w_gate_up.shape[0]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts[:num_experts]):  # skipped ids (E) sort last
        if count == 0:
            continue
        rows = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate_up = x[tokens] @ w_gate_up[expert].t()
        hidden = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = hidden @ w_down[expert].t()
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[rows, None])
    return out.to(x.dtype)
