"""The CPU MoE torch paths (grouped matmuls, dense small batches, one token) == the reference expert
loop. They serve when the C kernel does not (kernels off, no compiler, bf16, large prefill chunks),
so this module runs with the C kernels off; test_native_moe_experts.py covers the kernel."""

from __future__ import annotations

import torch
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu.moe import experts_cpu
from kernels import native
from kernels.cpu import moe as moe_cpu
from kernels.moe_ref import experts_ref, route_ref


@pytest.fixture(autouse=True)
def torch_paths_only():
    before = native.enabled()
    native.set_enabled(False)
    yield
    native.set_enabled(before)


@contextmanager
def dense_calls():
    """Rows of each call of the CPU path's dense branch while the block runs."""
    calls: list[int] = []
    original = moe_cpu._dense

    def spy(x, *args):
        calls.append(x.shape[0])
        return original(x, *args)

    moe_cpu._dense = spy
    try:
        yield calls
    finally:
        moe_cpu._dense = original


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(8, 2), (16, 4), (5, 1)]), st.sampled_from([(32, 16), (20, 12)]),
       st.floats(0.0, 3.0), st.integers(0, 10_000))
def test_matches_reference(tokens, experts, dims, skew, seed):
    """Skewed routing leaves experts idle; (20, 12) dims are not 16-byte aligned -> fallback path."""
    num_experts, top_k = experts
    hidden, inter = dims
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w_down = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    bias = torch.randn(num_experts, generator=g) * skew
    weights, ids = route_ref(torch.randn(tokens, num_experts, generator=g), bias, top_k=top_k)
    torch.testing.assert_close(experts_cpu(x, w_gate_up, w_down, weights, ids),
                               experts_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)


def test_no_tokens_gives_empty_output():
    x = torch.zeros(0, 16)
    out = experts_cpu(x, torch.zeros(4, 16, 16), torch.zeros(4, 16, 8), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 16)


def test_kernel_layout_keeps_values_and_results():
    """Column-major expert stacks (what the model runner installs on CPU): same shape and values,
    the grouped GEMMs read their transposes contiguously, and the experts give the reference result."""
    from kernels.cpu.moe import kernel_layout

    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 32, generator=g)
    w_gate_up = torch.randn(8, 32, 32, generator=g) * 0.2
    w_down = torch.randn(8, 32, 16, generator=g) * 0.2
    weights, ids = route_ref(torch.randn(24, 8, generator=g), None, top_k=2)
    gu, dn = kernel_layout(w_gate_up), kernel_layout(w_down)
    assert torch.equal(gu, w_gate_up) and gu.shape == w_gate_up.shape
    assert gu.transpose(1, 2).is_contiguous() and dn.transpose(1, 2).is_contiguous()
    assert kernel_layout(gu).data_ptr() == gu.data_ptr()  # idempotent: no second copy
    torch.testing.assert_close(experts_cpu(x, gu, dn, weights, ids),
                               experts_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(experts_cpu(x[:1], gu, dn, weights[:1], ids[:1]),
                       experts_ref(x[:1], gu, dn, weights[:1], ids[:1]))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.sampled_from([(4, 2), (8, 2), (16, 4), (5, 1)]), st.floats(0.0, 3.0),
       st.integers(0, 10_000))
def test_small_batches_run_dense_and_match_reference(tokens, experts, skew, seed):
    """2..SMALL_M rows of a small model (an MTP verify step): the dense path serves them, also when
    skewed routing leaves experts idle (their zero weights must not leak in)."""
    num_experts, top_k = experts
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g)
    w_gate_up = torch.randn(num_experts, 32, 32, generator=g) * 0.2
    w_down = torch.randn(num_experts, 32, 16, generator=g) * 0.2
    bias = torch.randn(num_experts, generator=g) * skew
    weights, ids = route_ref(torch.randn(tokens, num_experts, generator=g), bias, top_k=top_k)
    with dense_calls() as calls:
        got = experts_cpu(x, w_gate_up, w_down, weights, ids)
    assert calls == [tokens]
    torch.testing.assert_close(got, experts_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)


def test_dense_only_while_idle_expert_weights_are_small(monkeypatch):
    """With a byte budget of one idle expert: a batch using 7 of 8 experts runs dense, one using 2
    takes the grouped path, and more rows than SMALL_M never run dense."""
    g = torch.Generator().manual_seed(1)
    w_gate_up = torch.randn(8, 32, 32, generator=g) * 0.2
    w_down = torch.randn(8, 32, 16, generator=g) * 0.2
    per_expert = (32 * 32 + 32 * 16) * 4
    monkeypatch.setattr(moe_cpu, "DENSE_IDLE_BYTES", per_expert)
    x = torch.randn(16, 32, generator=g)
    cases = [(torch.tensor([[0, 1], [2, 3], [4, 5], [6, 0]]), True),  # 7 of 8 used: one idle
             (torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]]), False),  # 6 idle
             (torch.arange(16).remainder(8).view(8, 2).repeat(2, 1), False)]  # 16 rows > SMALL_M
    for ids, dense in cases:
        weights = torch.rand(ids.shape, generator=g)
        with dense_calls() as calls:
            got = experts_cpu(x[: ids.shape[0]], w_gate_up, w_down, weights, ids)
        assert bool(calls) == dense
        torch.testing.assert_close(got, experts_ref(x[: ids.shape[0]], w_gate_up, w_down, weights, ids),
                                   rtol=1e-5, atol=1e-5)


def test_odd_token_counts_take_the_grouped_path(monkeypatch):
    """The activations reach grouped_mm as a fresh gathered copy, so an odd number of rows (a
    same-prefix step of 31 uncached tokens) must not fall back to the per-expert reference loop."""
    g = torch.Generator().manual_seed(5)
    w_gate_up = torch.randn(8, 32, 32, generator=g) * 0.2
    w_down = torch.randn(8, 32, 16, generator=g) * 0.2
    for tokens in (9, 13, 31):
        x = torch.randn(tokens, 32, generator=g)
        weights, ids = route_ref(torch.randn(tokens, 8, generator=g), None, top_k=2)
        want = experts_ref(x, w_gate_up, w_down, weights, ids)

        def refused(*_args):
            raise AssertionError(f"{tokens} rows fell back to the reference loop")

        monkeypatch.setattr(moe_cpu, "experts_ref", refused)
        got = experts_cpu(x, w_gate_up, w_down, weights, ids)
        monkeypatch.undo()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
