"""The C router + experts call (moe_route_experts in kernels/native/moe_experts.c) == route_ref on
the router logits, then experts_ref, to fp32 rounding: sigmoid scores, correction bias, group top-k,
renormalisation, scaling; a tie at the k-th place is left to torch (None)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from kernels.cpu.moe import kernel_layout
from kernels.moe_ref import experts_ref, route_ref
from kernels.native.moe_experts import available, moe_route_experts

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler or native kernels off")


def case(tokens, hidden, inter, experts, *, seed, bias_scale=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    bias = torch.randn(experts, generator=g) * bias_scale
    w_gate_up = kernel_layout(torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5)
    w_down = kernel_layout(torch.randn(experts, hidden, inter, generator=g) * inter**-0.5)
    return x, router, bias, w_gate_up, w_down


def reference(x, router, bias, w_gate_up, w_down, **routing):
    weights, ids = route_ref(F.linear(x, router), bias, **routing)
    return experts_ref(x, w_gate_up, w_down, weights, ids)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(16, 2, 1, 1), (16, 4, 4, 2), (8, 3, 2, 2), (12, 1, 3, 1)]),
       st.booleans(), st.sampled_from([1.0, 2.5]), st.floats(0.0, 2.0), st.integers(0, 10_000))
def test_matches_router_then_experts(tokens, routing, renormalize, scaling, bias_scale, seed):
    experts, top_k, n_group, topk_group = routing
    args = case(tokens, 32, 16, experts, seed=seed, bias_scale=bias_scale)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
              routed_scaling_factor=scaling)
    got = moe_route_experts(*args, **kw)
    assert got is not None
    torch.testing.assert_close(got, reference(*args, **kw), rtol=1e-5, atol=1e-5)


def test_the_residual_is_added_last_as_the_layer_adds_it():
    """out = residual + experts: bit for bit what the decoder layer's x + mlp(h) gives."""
    x, router, bias, w_gate_up, w_down = case(6, 32, 16, 8, seed=7)
    residual = torch.randn(6, 32)
    alone = moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=2)
    assert torch.equal(moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=2, residual=residual),
                       residual + alone)
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=2, residual=residual[:5]) is None


def test_no_bias_and_mimo_shaped():
    x, router, _, w_gate_up, w_down = case(8, 256, 128, 64, seed=5)
    got = moe_route_experts(x, router, None, w_gate_up, w_down, top_k=8)
    torch.testing.assert_close(got, reference(x, router, None, w_gate_up, w_down, top_k=8), rtol=1e-5, atol=1e-5)


def test_a_tie_at_the_kth_place_is_left_to_torch():
    """Equal router rows give equal scores: which of them torch's topk keeps is its own affair."""
    x, router, bias, w_gate_up, w_down = case(4, 32, 16, 8, seed=1)
    router[5] = router[2]
    bias[5] = bias[2] = 10.0  # both certainly chosen among the best: a tie, but not at the k-th place
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=2) is not None
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=1) is None  # tie for the only place


def test_refuses_what_it_cannot_take():
    x, router, bias, w_gate_up, w_down = case(4, 32, 16, 8, seed=2)
    assert moe_route_experts(x, router, bias, w_gate_up.contiguous(), w_down, top_k=2) is None  # row-major
    assert moe_route_experts(x.bfloat16(), router, bias, w_gate_up, w_down, top_k=2) is None
    assert moe_route_experts(x, router[:7], bias, w_gate_up, w_down, top_k=2) is None
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=9) is None
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=2, n_group=3) is None  # 8 % 3
    assert moe_route_experts(x, router, bias, w_gate_up, w_down, top_k=5, n_group=4, topk_group=2) is None
