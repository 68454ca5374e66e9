"""CPU fast paths that promise bit-exact results: in-place RoPE == rotate-half, the one-token MoE path
== the expert loop, and per-step attention plans reused across layers == a fresh plan per call."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_ref import paged_attention_ref
from kernels.cpu.moe import experts_cpu
from kernels.moe_ref import experts_ref, route_ref
from kernels.cpu.attention_plan import AttentionPlan
from kernels.cpu.paged_attention import paged_attention_cpu
from llm_core.model.layers.rope import PartialRotary


def rotate_half_ref(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """transformers' form: x * cos + rotate_half(x) * sin on the rotary columns."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.sampled_from([(2, 8, 8), (3, 10, 4), (1, 6, 6)]), st.integers(0, 10_000))
def test_in_place_rope_is_bit_exact(tokens, dims, seed):
    heads, head_dim, rotary_dim = dims
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g)
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    rope = PartialRotary(rotary_dim, 10_000.0)
    cos, sin = rope.tables(positions, x.dtype)
    got = rope.apply_(x.clone(), cos, sin)
    assert torch.equal(got, rotate_half_ref(x, positions, rotary_dim, 10_000.0))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(8, 2), (16, 4), (5, 1)]), st.integers(0, 10_000))
def test_one_token_moe_is_bit_exact(experts, seed):
    num_experts, top_k = experts
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 32, generator=g)
    w_gate_up = torch.randn(num_experts, 32, 32, generator=g) * 0.2
    w_down = torch.randn(num_experts, 32, 16, generator=g) * 0.2
    weights, ids = route_ref(torch.randn(1, num_experts, generator=g), None, top_k=top_k)
    assert torch.equal(experts_cpu(x, w_gate_up, w_down, weights, ids),
                       experts_ref(x, w_gate_up, w_down, weights, ids))


def test_one_plan_serves_every_layer_of_a_step():
    """A plan built once gives each layer (different caches, queries, sinks) the reference result."""
    g = torch.Generator().manual_seed(0)
    page, lens, new = 4, [9, 1, 14], [1, 1, 3]
    table = torch.tensor([[5, 2, 7, -1], [0, -1, -1, -1], [1, 3, 4, 6]])
    qsl = torch.tensor([0] + new).cumsum(0)
    seq_lens = torch.tensor(lens)
    plan = AttentionPlan.build(table, qsl, seq_lens, page_size=page, window=6)
    for _ in range(3):
        k = torch.randn(32, 2, 8, generator=g)
        v = torch.randn(32, 2, 8, generator=g)
        q = torch.randn(int(qsl[-1]), 4, 8, generator=g)
        sinks = torch.randn(4, generator=g)
        kw = dict(page_size=page, scale=8**-0.5, window=6, sinks=sinks)
        got = paged_attention_cpu(q, k, v, table, qsl, seq_lens, plan=plan, **kw)
        torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, qsl, seq_lens, **kw),
                                   rtol=1e-5, atol=1e-5)


def test_decode_padding_never_reads_unwritten_slots():
    """Padding cells of the decode grid re-read a written slot: NaN elsewhere in the pool stays out."""
    page = 4
    table = torch.tensor([[1, 2, 4], [3, -1, -1]])  # page 0 (slot 0 included) is never written
    qsl, seq_lens = torch.tensor([0, 1, 2]), torch.tensor([11, 2])
    k = torch.full((20, 1, 8), float("nan"))
    v = torch.full((20, 1, 8), float("nan"))
    written = torch.tensor(list(range(4, 12)) + [16, 17, 18] + [12, 13])
    k[written] = torch.randn(13, 1, 8)
    v[written] = torch.randn(13, 1, 8)
    q = torch.randn(2, 2, 8)
    out = paged_attention_cpu(q, k, v, table, qsl, seq_lens, page_size=page, scale=0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, table, qsl, seq_lens, page_size=page, scale=0.3),
                               rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 70), st.sampled_from([8, 37, 48, 256, 4096]), st.integers(0, 10_000))
def test_fused_rms_norm_is_bit_exact(tokens, hidden, seed):
    """RMSNorm's fused ATen kernel (in fp32 with the weight inside it) == transformers' four-op form,
    bit for bit."""
    from llm_core.model.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=g)
    x = torch.randn(tokens, hidden, generator=g) * 3
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(norm(x), want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20_000), min_size=1, max_size=70), st.sampled_from([(32, 1e4), (24, 1e6), (6, 5e6)]),
       st.booleans())
def test_rotary_tables_from_the_memo_are_bit_exact(positions, setup, grow_first):
    """PartialRotary.tables' CPU memo (rows of every position below the largest seen, up to
    MEMO_POSITIONS; past it computed directly) gives the bits computed for the step itself."""
    from llm_core.model.layers import rope

    rot = PartialRotary(*setup)
    if grow_first:
        rot.tables(torch.tensor([3]), torch.float32)  # a small memo first: the batch below may grow it
    pos = torch.tensor(positions)
    got = rot.tables(pos, torch.float32)
    want = rot._compute(pos, torch.float32)
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, want))
    memo = rot._memo.get(torch.float32)
    if max(positions) < rope.MEMO_POSITIONS:  # served from the memo, which covers them
        assert memo is not None and max(positions) < memo[0].shape[0] <= rope.MEMO_POSITIONS
