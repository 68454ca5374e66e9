"""The C MoE expert kernel (kernels/native/moe_experts.c) == the torch reference to fp32 rounding;
it refuses what it cannot take (the caller's torch path then serves) and rejects bad expert ids."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import native
from kernels.cpu import moe as moe_cpu
from kernels.cpu.moe import experts_cpu, kernel_layout
from kernels.moe_ref import experts_ref, route_ref
from kernels.native.moe_experts import available, moe_experts, moe_route_experts
from tests.support.intra_op import on_threads

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler or native kernels off")


def case(tokens, hidden, inter, num_experts, top_k, *, seed=0, skew=0.0, layout=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    bias = torch.randn(num_experts, generator=g) * skew
    weights, ids = route_ref(torch.randn(tokens, num_experts, generator=g), bias, top_k=top_k)
    if layout:
        w_gate_up, w_down = kernel_layout(w_gate_up), kernel_layout(w_down)
    return x, w_gate_up, w_down, weights, ids


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.sampled_from([(8, 2), (16, 4), (5, 1), (1, 1)]),
       st.sampled_from([(32, 16), (20, 12), (8, 3), (1, 1)]), st.floats(0.0, 3.0), st.integers(0, 10_000))
def test_matches_reference(tokens, experts, dims, skew, seed):
    """Odd widths (20/12, 8/3, 1/1) exercise the vector tails; skewed routing leaves experts idle or
    gives one expert every row; zero tokens give an empty result."""
    (num_experts, top_k), (hidden, inter) = experts, dims
    args = case(tokens, hidden, inter, num_experts, top_k, seed=seed, skew=skew)
    got = moe_experts(*args)
    assert got is not None and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, experts_ref(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 32, 130])
def test_mimo_shaped_experts(tokens):
    """MiMo-V2.5's shape scaled down (H 4096 -> 256, I 2048 -> 128: still H = 2I; 256 -> 64 experts,
    top-8 kept): rows spread thinly over many experts, most of them idle at a few tokens."""
    args = case(tokens, 256, 128, 64, 8, seed=tokens)
    torch.testing.assert_close(moe_experts(*args), experts_ref(*args), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """k ascending, one multiply-add per k, whatever the batch: a token's output is bit-identical
    alone and inside a batch (so batch size cannot flip a greedy token through the experts)."""
    x, w_gate_up, w_down, weights, ids = case(24, 32, 16, 8, 2, seed=4)
    batched = moe_experts(x, w_gate_up, w_down, weights, ids)
    for t in (0, 7, 23):
        alone = moe_experts(x[t : t + 1], w_gate_up, w_down, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batched[t])


def test_refuses_what_it_cannot_take():
    x, w_gate_up, w_down, weights, ids = case(4, 32, 16, 8, 2, layout=False)
    assert moe_experts(x, w_gate_up, w_down, weights, ids) is None  # row-major weights
    gu, dn = kernel_layout(w_gate_up), kernel_layout(w_down)
    assert moe_experts(x.bfloat16(), gu.bfloat16(), dn.bfloat16(), weights, ids) is None
    assert moe_experts(x, gu, dn, weights, ids.int()) is None
    native.set_enabled(False)
    try:
        assert moe_experts(x, gu, dn, weights, ids) is None
    finally:
        native.set_enabled(True)
    assert moe_experts(x, gu, dn, weights, ids) is not None


def test_bad_expert_ids_and_shapes_raise():
    x, w_gate_up, w_down, weights, ids = case(4, 32, 16, 8, 2)
    for bad in (-1, 8, 1 << 40):
        wrong = ids.clone()
        wrong[2, 1] = bad
        with pytest.raises(ValueError, match="outside"):
            moe_experts(x, w_gate_up, w_down, weights, wrong)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x[:, :16], w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x, w_gate_up, w_down, weights[:3], ids[:3])


def test_experts_cpu_routes_every_step_under_the_byte_cap_to_the_kernel(monkeypatch):
    """experts_cpu takes the C kernel for any step whose (token, expert) rows hold at most
    NATIVE_MAX_BYTES of activations -- a few rows per expert and a long prefill chunk alike -- and
    grouped_mm past the cap; both give the reference's values."""
    served = []

    def spy(*args):
        served.append(args[0].shape[0])
        return moe_experts(*args)

    monkeypatch.setattr(moe_cpu, "moe_experts", spy)
    hidden, top_k = 32, 2
    for tokens in (1, 5, 300):  # 300 tokens over 4 experts: 150 rows per expert
        args = case(tokens, hidden, 16, 4, top_k, seed=tokens)
        torch.testing.assert_close(experts_cpu(*args), experts_ref(*args), rtol=1e-5, atol=1e-5)
    assert served == [1, 5, 300]
    served.clear()
    cap = moe_cpu.NATIVE_MAX_BYTES // (top_k * hidden * 4)  # tokens at the cap
    monkeypatch.setattr(moe_cpu, "NATIVE_MAX_BYTES", 40 * top_k * hidden * 4)  # a cap this test can reach
    assert cap > 300 and moe_cpu.native_serves(40, top_k, hidden) and not moe_cpu.native_serves(41, top_k, hidden)
    for tokens in (40, 41):
        args = case(tokens, hidden, 16, 4, top_k, seed=tokens)
        torch.testing.assert_close(experts_cpu(*args), experts_ref(*args), rtol=1e-5, atol=1e-5)
    assert served == [40]


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 400), st.sampled_from([(8, 2), (4, 2), (16, 4), (3, 3)]), st.floats(0.0, 3.0),
       st.integers(0, 10_000))
def test_a_wide_thread_splits_a_long_call_with_the_same_bits(tokens, experts, skew, seed):
    """On a thread at 2 intra-op threads (the engine thread's wide step) a call of >= 64 tokens splits
    its experts' rows among the team and combines each token's rows in expert order: the output, and
    the router's split over tokens with it, equal one thread's bit for bit -- skewed routing gives one expert
    most rows (several work items of one expert), top-3 of 3 experts every token every expert."""
    (num_experts, top_k) = experts
    x, w_gate_up, w_down, weights, ids = case(tokens, 48, 20, num_experts, top_k, seed=seed, skew=skew)
    gate = torch.randn(num_experts, 48, generator=torch.Generator().manual_seed(seed)) * 0.3
    bias = torch.zeros(num_experts)

    def run():
        return (moe_experts(x, w_gate_up, w_down, weights, ids),
                moe_route_experts(x, gate, bias, w_gate_up, w_down, top_k=top_k, n_group=1, topk_group=1,
                                  renormalize=True, routed_scaling_factor=1.0, residual=x))

    (one, routed_one), (two, routed_two) = on_threads(1, run), on_threads(2, run)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, experts_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)
    assert (routed_one is None) == (routed_two is None)
    if routed_one is not None:
        assert torch.equal(routed_one, routed_two)


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 63), st.sampled_from([(8, 2), (16, 4)]), st.floats(0.0, 3.0), st.integers(0, 10_000))
def test_a_short_call_with_enough_work_splits_on_a_wide_thread_with_the_same_bits(tokens, experts, skew, seed):
    """Fewer tokens than PARALLEL_ROWS whose experts' work reaches team.h's SPLIT_MACS (a question after a
    prefix-cache hit: ~30 tokens, hidden 256) split among a wide thread's team as a long call does: one
    thread's output bit for bit."""
    num_experts, top_k = experts
    x, w_gate_up, w_down, weights, ids = case(tokens, 256, 128, num_experts, top_k, seed=seed, skew=skew)

    def run():
        return moe_experts(x, w_gate_up, w_down, weights, ids)

    one, two = on_threads(1, run), on_threads(2, run)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, experts_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-4, atol=1e-4)
