"""Triton fused MoE (sort by expert, grouped gate/up + SiLU*mul + down GEMMs, weighted combine) vs
``moe_ref.experts_ref``; the sort/pad layout is checked on its own. Kernel tests run on CPU in a
TRITON_INTERPRET=1 child (see test_kernels_support)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.kernels.test_kernels_support import DEVICE, interpreter_rerun, kernel_test, run_under_interpreter

from kernels import ops
from kernels.moe_ref import experts_ref, route_ref
from kernels.moe_triton import align_by_expert, fused_experts_triton


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


def make_moe(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.1
    weights, ids = route_ref(logits, bias, top_k=top_k)
    return x, w_gate_up, w_down, weights, ids


@kernel_test
@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([8, 24, 40]), inter=st.sampled_from([8, 20, 36]),
       experts=st.integers(1, 8), top_k=st.integers(1, 3), seed=st.integers(0, 2**16),
       blocks=st.sampled_from([(16, 16, 16), (None, 64, 64)]))
def test_matches_reference(tokens, hidden, inter, experts, top_k, seed, blocks) -> None:
    """Odd hidden/intermediate sizes hit the masked tails; 16-wide blocks loop over several K tiles."""
    top_k = min(top_k, experts)
    args = make_moe(seed, tokens, hidden, inter, experts, top_k)
    ref = experts_ref(*args)
    block_m, block_n, block_k = blocks
    out = fused_experts_triton(*(a.to(DEVICE) for a in args), block_m=block_m, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@kernel_test
def test_many_tokens_on_one_expert_span_several_blocks_and_dispatch() -> None:
    # 40 tokens all routed to expert 2 (and one of 0/1): expert 2's run covers three 16-row blocks.
    x, w_gate_up, w_down, _, _ = make_moe(7, 40, 24, 20, 4, 2)
    ids = torch.stack([torch.full((40,), 2), torch.arange(40) % 2], dim=1)
    weights = torch.rand(40, 2, generator=torch.Generator().manual_seed(1))
    ref = experts_ref(x, w_gate_up, w_down, weights, ids)
    got = ops.fused_experts(*(a.to(DEVICE) for a in (x, w_gate_up, w_down, weights, ids)))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


def skip_some(seed: int, tokens: int, experts: int, top_k: int, share: float):
    """MoE inputs whose entries are skipped (id E: another rank's expert) with probability ``share``,
    and what they must give: the reference with those entries' weights zeroed instead."""
    x, w_gate_up, w_down, weights, ids = make_moe(seed, tokens, 24, 20, experts, min(top_k, experts))
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed + 1)) < share
    want = experts_ref(x, w_gate_up, w_down, weights.masked_fill(mask, 0.0), ids)
    return (x, w_gate_up, w_down, weights, ids.masked_fill(mask, experts)), want


@kernel_test
@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       share=st.sampled_from([0.0, 0.5, 1.0]), block_m=st.sampled_from([16, None]), seed=st.integers(0, 2**16))
def test_skipped_entries_add_nothing_in_the_kernel(tokens, experts, top_k, share, block_m, seed) -> None:
    """Expert parallelism's skipped ids sort into a bucket of their own whose rows the down kernel
    zeroes (none, half and all of the entries skipped; several blocks per expert at 40 tokens)."""
    args, want = skip_some(seed, tokens, experts, top_k, share)
    out = fused_experts_triton(*(a.to(DEVICE) for a in args), block_m=block_m, block_n=16, block_k=16, skipped=True)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       share=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_skipped_entries_add_nothing_on_cpu(tokens, experts, top_k, share, seed) -> None:
    """The CPU paths (C kernel, one token, dense, grouped) take only this rank's entries; the
    reference skips the others too."""
    args, want = skip_some(seed, tokens, experts, top_k, share)
    torch.testing.assert_close(experts_ref(*args), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.fused_experts(*args, skipped=True), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 30), experts=st.integers(1, 9), top_k=st.integers(1, 4), block_m=st.sampled_from([16, 64]),
       seed=st.integers(0, 2**16))
def test_align_by_expert_layout(tokens, experts, top_k, block_m, seed) -> None:
    """Every entry appears exactly once, inside a block owned by its own expert; pads are id N."""
    top_k = min(top_k, experts)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    sorted_ids, block_expert = align_by_expert(ids, experts, block_m)
    n = tokens * top_k
    assert sorted_ids.shape[0] == block_expert.shape[0] * block_m
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))
    assert bool((sorted_ids[sorted_ids >= n] == n).all())
    owner = block_expert.repeat_interleave(block_m)
    flat = ids.reshape(-1)
    pos = (sorted_ids < n).nonzero().squeeze(1)
    assert torch.equal(owner[pos].long(), flat[sorted_ids[pos].long()])
    assert bool((block_expert <= experts).all())


def test_wrapper_rejects_bad_inputs() -> None:
    x, w_gate_up, w_down, weights, ids = make_moe(0, 2, 8, 8, 2, 1)
    with pytest.raises(ValueError, match="do not match"):
        fused_experts_triton(x, w_gate_up[:, :, :4], w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_ids/topk_weights"):
        fused_experts_triton(x, w_gate_up, w_down, weights[:1], ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts_triton(x, w_gate_up.double(), w_down, weights, ids)
    with pytest.raises(ValueError, match="int32/int64"):
        fused_experts_triton(x, w_gate_up, w_down, weights, ids.float())
    with pytest.raises(ValueError, match="power of two"):
        fused_experts_triton(x, w_gate_up, w_down, weights, ids, block_k=24)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights(dtype: torch.dtype) -> None:
    """bf16/fp16 activations and weights: compared with the fp32 reference on the same rounded values."""
    x, w_gate_up, w_down, weights, ids = make_moe(9, 6, 40, 36, 4, 2)
    x, w_gate_up, w_down = (t.to(dtype) for t in (x, w_gate_up, w_down))
    ref = experts_ref(x.float(), w_gate_up.float(), w_down.float(), weights, ids)
    out = fused_experts_triton(*(a.to(DEVICE) for a in (x, w_gate_up, w_down, weights, ids)), block_k=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref, atol=3e-2, rtol=3e-2)
