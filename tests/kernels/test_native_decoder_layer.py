"""The C layer glue (kernels/native/decoder_layer.c) == the torch ops it replaces, to fp32 rounding:
the attention front (input norm -> QKV -> RoPE -> value scale -> KV store) and the attention output
(o_proj -> residual add -> post-attention norm) and the dense MLP, and a long step's glue around torch's
projections (RoPE + value scale + KV store on the projection; residual add + norm); it refuses what it
cannot take and rejects slots outside the pool before writing anything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from kernels import native, ops
from kernels.kv_copy_ref import store_kv_ref
from kernels.native import decoder_layer
from kernels.native.decoder_layer import (add_rms_norm, attention_front, attention_out, available, dense_mlp,
                                          rope_store)
from llm_core.model.layers.rope import PartialRotary
from tests.support.intra_op import on_threads

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler or native kernels off")


def front_case(t, hidden, hq, hkv, d, dv, rot, *, seed, slots_pool=64, norm=True):
    g = torch.Generator().manual_seed(seed)
    n = (hq + hkv) * d + hkv * dv
    x = torch.randn(t, hidden, generator=g)
    w = ops.linear_weight_layout(torch.randn(n, hidden, generator=g) * hidden**-0.5)
    nw = torch.rand(hidden, generator=g) + 0.5 if norm else None
    cos, sin = PartialRotary(rot, 10_000.0).tables(torch.randint(0, 4000, (t,), generator=g), torch.float32)
    slots = torch.randperm(slots_pool, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1  # padding rows: not stored
    return x, nw, w, cos, sin, slots


def front_ref(x, nw, w, cos, sin, slots, hq, hkv, d, dv, rot, value_scale, k_cache, v_cache):
    """The torch path of Attention.write_kv (norm first, as the decoder layer applies it)."""
    t = x.shape[0]
    h = x if nw is None else F.rms_norm(x, (x.shape[1],), nw, 1e-6)
    qkv = F.linear(h, w)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, dv)
    v.mul_(value_scale)
    PartialRotary(rot, 10_000.0).apply_(qk, cos, sin)
    store_kv_ref(k_cache, v_cache, slots, qk[:, hq:], v)
    return qkv


@pytest.fixture(params=["host tiles", "AVX2 tiles"])
def tile_form(request, monkeypatch):
    """The host's register tiles, and the 8-lane AVX2 tiles that AVX2-only CPUs build (-DSMALL_GEMM_AVX2
    makes an AVX-512 host build them too; on an AVX2-only host the two are the same)."""
    if request.param == "AVX2 tiles":
        monkeypatch.setattr(decoder_layer, "_FLAGS", decoder_layer._FLAGS + ("-DSMALL_GEMM_AVX2",))
    return request.param


@pytest.mark.parametrize("t", [9, 17, 32])
def test_tile_edges_give_a_row_the_same_bits_alone_and_in_a_batch(tile_form, t):
    """Widths off the tiles' columns (900 = 56 x 16 + 4, 245 = 15 x 16 + 5: masked loads and stores) and
    row counts off their 6 rows (9 = 6 + 3, 17 = 12 + 5, 32 = 30 + 2): each row of the batch (register tiles)
    equals the row alone (the stream) bit for bit, and torch to rounding."""
    g = torch.Generator().manual_seed(t)
    hidden, inter = 245, 900
    h = torch.randn(t, hidden, generator=g)
    w_gate, w_up = (ops.linear_weight_layout(torch.randn(inter, hidden, generator=g) * hidden**-0.5) for _ in range(2))
    w_down = ops.linear_weight_layout(torch.randn(hidden, inter, generator=g) * inter**-0.5)
    batched = dense_mlp(h, w_gate, w_up, w_down)
    want = F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)
    torch.testing.assert_close(batched, want, rtol=1e-5, atol=1e-5)
    for r in range(t):
        assert torch.equal(dense_mlp(h[r : r + 1], w_gate, w_up, w_down)[0], batched[r])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(256, 8, 2, 32, 32, 10), (48, 4, 4, 16, 8, 16), (20, 3, 1, 6, 5, 0),
                                            (16, 2, 2, 8, 8, 8)]),
       st.sampled_from([1.0, 0.707]), st.booleans(), st.integers(0, 10_000))
def test_front_matches_torch(t, dims, value_scale, norm, seed):
    """Odd widths (N = 29, 48 + 8: not a multiple of 64 or 16) exercise the tile tails; rot 0 (no
    RoPE) and rot == head_dim the rotary bounds; padding slots (-1) must not be written."""
    hidden, hq, hkv, d, dv, rot = dims
    x, nw, w, cos, sin, slots = front_case(t, hidden, hq, hkv, d, dv, rot, seed=seed, norm=norm)
    pools = [(torch.full((64, hkv, d), float("nan")), torch.full((64, hkv, dv), float("nan"))) for _ in range(2)]
    want = front_ref(x, nw, w, cos, sin, slots, hq, hkv, d, dv, rot, value_scale, *pools[0])
    got = attention_front(x, nw, 1e-6, w, num_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, cos=cos,
                          signed_sin=sin, value_scale=value_scale, k_cache=pools[1][0], v_cache=pools[1][1],
                          slots=slots)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ref, ours in zip(pools[0], pools[1]):  # the same slots written, the others untouched (NaN)
        assert torch.equal(ref.isnan(), ours.isnan())
        torch.testing.assert_close(ours.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Register tiles of 6 rows, k ascending from zero: a row is bit-identical alone or in a batch."""
    x, nw, w, cos, sin, slots = front_case(32, 256, 8, 2, 32, 32, 10, seed=3)
    pool = lambda: (torch.zeros(64, 2, 32), torch.zeros(64, 2, 32))  # noqa: E731
    call = lambda rows, k, v: attention_front(x[rows], nw, 1e-6, w, num_heads=8, num_kv_heads=2, head_dim=32,  # noqa: E731
                                              v_head_dim=32, cos=cos[rows], signed_sin=sin[rows], value_scale=1.0,
                                              k_cache=k, v_cache=v, slots=slots[rows])
    batched = call(slice(0, 32), *pool())
    for t in (0, 13, 31):
        assert torch.equal(call(slice(t, t + 1), *pool())[0], batched[t])


def test_zero_rows_give_empty_results():
    x, nw, w, cos, sin, slots = front_case(0, 16, 2, 2, 8, 8, 8, seed=1)
    k, v = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)
    got = attention_front(x, nw, 1e-6, w, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, cos=cos,
                          signed_sin=sin, value_scale=1.0, k_cache=k, v_cache=v, slots=slots)
    assert got.shape == (0, 48) and not k.any()
    w_o = ops.linear_weight_layout(torch.randn(16, 8))
    assert [t.shape for t in attention_out(torch.zeros(0, 8), w_o, torch.zeros(0, 16), nw, 1e-6)] == [(0, 16)] * 2
    w_in = ops.linear_weight_layout(torch.randn(8, 16))
    assert dense_mlp(torch.zeros(0, 16), w_in, w_in, w_o).shape == (0, 16)


def test_front_slot_outside_the_pool_raises_before_writing():
    x, nw, w, cos, sin, slots = front_case(5, 16, 2, 2, 8, 8, 8, seed=1)
    k, v = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)
    slots[3] = 64
    with pytest.raises(ValueError, match="outside the pool"):
        attention_front(x, nw, 1e-6, w, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, cos=cos, signed_sin=sin,
                        value_scale=1.0, k_cache=k, v_cache=v, slots=slots)
    assert not k.any() and not v.any()


def test_front_refuses_what_it_cannot_take():
    x, nw, w, cos, sin, slots = front_case(4, 16, 2, 2, 8, 8, 8, seed=2)
    k, v = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)

    def call(**over):
        args = dict(x=x, norm_weight=nw, eps=1e-6, w_qkv=w, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8,
                    cos=cos, signed_sin=sin, value_scale=1.0, k_cache=k, v_cache=v, slots=slots)
        args.update(over)
        return attention_front(**args)

    assert call(w_qkv=w.contiguous()) is None  # row-major weight
    assert call(x=x.bfloat16()) is None
    assert call(slots=slots.int()) is None
    assert call(num_heads=3) is None  # the weight's rows do not fit the heads
    assert call(k_cache=torch.zeros(64, 2, 8).transpose(0, 1).contiguous().transpose(0, 1)) is None
    native.set_enabled(False)
    try:
        assert call() is None
    finally:
        native.set_enabled(True)
    assert call() is not None


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(256, 256), (24, 40), (7, 9)]), st.integers(0, 10_000))
def test_out_matches_torch(t, dims, seed):
    a, hidden = dims
    g = torch.Generator().manual_seed(seed)
    attn, x = torch.randn(t, a, generator=g), torch.randn(t, hidden, generator=g)
    w_o = ops.linear_weight_layout(torch.randn(hidden, a, generator=g) * a**-0.5)
    nw = torch.rand(hidden, generator=g) + 0.5
    got = attention_out(attn, w_o, x, nw, 1e-6)
    want = x + F.linear(attn, w_o)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], F.rms_norm(want, (hidden,), nw, 1e-6), rtol=1e-5, atol=1e-5)
    assert attention_out(attn, w_o.contiguous() if a != hidden else w_o.t(), x, nw, 1e-6) is None
    assert attention_out(attn.double(), w_o, x, nw, 1e-6) is None


def test_the_silu_in_c_matches_torch_over_the_whole_float_range():
    """The C SiLU (row_ops.h silu_mul_row: a vectorized exp of its own, no libm call) against torch's on
    gate values from -200 to 200, the exp's clamps at -87.3 and 88 and both sides of them included:
    identity weights make the dense MLP's output exactly silu(h) * h."""
    edges = torch.tensor([-200.0, -100.0, -88.5, -88.0, -87.5, -87.3, -87.0, -1e-30, 0.0, 1e-30, 87.0, 88.0, 88.5, 100.0])
    h = torch.cat([torch.linspace(-200, 200, 4004), edges, -edges]).view(-1, 32)  # 4,032 values
    eye = ops.linear_weight_layout(torch.eye(32))
    got = dense_mlp(h, eye, eye, eye)
    want = F.silu(h) * h
    # past -88 the C exp of -g is inf (silu 0) where torch's sigmoid still underflows to ~1e-39: a few 1e-35
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-34)
    assert torch.equal(got.signbit(), want.signbit())


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(256, 512), (24, 40), (7, 9)]), st.booleans(), st.integers(0, 10_000))
def test_dense_mlp_matches_torch(t, dims, with_residual, seed):
    hidden, inter = dims
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=g)
    w_gate, w_up = (ops.linear_weight_layout(torch.randn(inter, hidden, generator=g) * hidden**-0.5) for _ in range(2))
    w_down = ops.linear_weight_layout(torch.randn(hidden, inter, generator=g) * inter**-0.5)
    residual = torch.randn(t, hidden, generator=g) if with_residual else None
    want = F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)
    want = want if residual is None else residual + want
    torch.testing.assert_close(dense_mlp(h, w_gate, w_up, w_down, residual), want, rtol=1e-5, atol=1e-5)
    assert dense_mlp(h, w_gate.contiguous() if inter != hidden else w_gate.t(), w_up, w_down) is None
    assert dense_mlp(h.bfloat16(), w_gate, w_up, w_down) is None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 300), st.sampled_from([(256, 8, 2, 32, 32, 10), (48, 4, 4, 16, 8, 16), (20, 3, 1, 6, 5, 0),
                                             (256, 8, 8, 24, 16, 8)]),
       st.sampled_from([1.0, 0.707]), st.booleans(), st.integers(0, 10_000))
def test_rope_store_on_a_torch_projection_matches_torch(t, dims, value_scale, norm, seed):
    """Any row count (a prompt's): the projection torch computed, rotated / scaled in place and stored
    exactly where the torch path stores it; padding slots (-1) untouched."""
    hidden, hq, hkv, d, dv, rot = dims
    x, nw, w, cos, sin, slots = front_case(t, hidden, hq, hkv, d, dv, rot, seed=seed, norm=norm, slots_pool=512)
    pools = [(torch.full((512, hkv, d), float("nan")), torch.full((512, hkv, dv), float("nan"))) for _ in range(2)]
    want = front_ref(x, nw, w, cos, sin, slots, hq, hkv, d, dv, rot, value_scale, *pools[0])
    h = x if nw is None else add_rms_norm(x, None, nw, 1e-6)[1]
    qkv = F.linear(h, w)
    assert rope_store(qkv, num_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, cos=cos, signed_sin=sin,
                      value_scale=value_scale, k_cache=pools[1][0], v_cache=pools[1][1], slots=slots)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
    for ref, ours in zip(pools[0], pools[1]):
        assert torch.equal(ref.isnan(), ours.isnan())
        torch.testing.assert_close(ours.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_rope_store_refuses_what_it_cannot_take_and_bad_slots_raise_before_writing():
    x, nw, w, cos, sin, slots = front_case(5, 16, 2, 2, 8, 8, 8, seed=1)
    k, v = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)
    qkv = F.linear(x, w)
    kw = dict(num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, cos=cos, signed_sin=sin, value_scale=1.0,
              k_cache=k, v_cache=v)
    assert not rope_store(qkv.double(), **kw, slots=slots)
    assert not rope_store(qkv, **kw, slots=slots.int())
    assert not rope_store(qkv.t().contiguous().t(), **kw, slots=slots)  # column-major rows
    assert not rope_store(qkv[:, :40], **kw, slots=slots)  # not the heads' width
    bad = slots.clone()
    bad[3] = 64
    before = qkv.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        rope_store(qkv, **kw, slots=bad)
    assert not k.any() and not v.any() and torch.equal(qkv, before)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 300), st.sampled_from([256, 24, 7]), st.booleans(), st.integers(0, 10_000))
def test_add_rms_norm_matches_torch(t, hidden, with_delta, seed):
    g = torch.Generator().manual_seed(seed)
    x, delta = torch.randn(t, hidden, generator=g), torch.randn(t, hidden, generator=g)
    nw = torch.rand(hidden, generator=g) + 0.5
    total, h = add_rms_norm(x, delta if with_delta else None, nw, 1e-6)
    want = x + delta if with_delta else x
    assert torch.equal(total, want)  # one fp32 add: exact
    torch.testing.assert_close(h, F.rms_norm(want, (hidden,), nw, 1e-6), rtol=1e-5, atol=1e-5)
    assert add_rms_norm(x.double(), None, nw.double(), 1e-6) is None
    assert add_rms_norm(x, delta.t() if t > 1 and hidden > 1 and t != hidden else delta[:, :0], nw, 1e-6) is None


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 400), st.booleans(), st.integers(0, 10_000))
def test_a_wide_thread_splits_a_long_glue_call_with_the_same_bits(t, with_delta, seed):
    """On a thread at 2 intra-op threads (the engine thread's wide step) rope_store and add_rms_norm
    split their rows among its team (kernels/native/build.py: OpenMP with torch's runtime): the
    results equal those of one thread bit for bit."""
    hidden, hq, hkv, d, dv, rot = 256, 8, 2, 32, 32, 10
    x, nw, w, cos, sin, slots = front_case(t, hidden, hq, hkv, d, dv, rot, seed=seed, norm=True, slots_pool=512)
    delta = torch.randn_like(x)
    qkv = F.linear(x, w)

    def glue():
        pools = (torch.full((512, hkv, d), float("nan")), torch.full((512, hkv, dv), float("nan")))
        q = qkv.clone()
        assert rope_store(q, num_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, cos=cos, signed_sin=sin,
                          value_scale=0.707, k_cache=pools[0], v_cache=pools[1], slots=slots)
        return (q, *pools, *add_rms_norm(x, delta if with_delta else None, nw, 1e-6))

    for one, two in zip(on_threads(1, glue), on_threads(2, glue)):
        assert torch.equal(one.nan_to_num(), two.nan_to_num()) and torch.equal(one.isnan(), two.isnan())


@settings(max_examples=10, deadline=None)
@given(st.integers(9, 64), st.sampled_from([(256, 8, 8, 24, 16, 512), (200, 4, 2, 36, 20, 333)]),
       st.integers(0, 10_000))
def test_a_wide_thread_splits_a_short_call_by_columns_with_the_same_bits(t, shape, seed):
    """A short step's projections (fewer rows than PARALLEL_ROWS, at least SPLIT_MACS multiply-adds) on a
    thread at 2 intra-op threads: each team thread takes whole 64-column groups of the output
    (small_gemm.h gemm_rows), a width that is not a multiple of 64 included, so every output is the
    one-thread call's bit for bit (and torch's to rounding)."""
    hidden, hq, hkv, d, dv, inter = shape
    rot = d // 2
    x, nw, w, cos, sin, slots = front_case(t, hidden, hq, hkv, d, dv, rot, seed=seed, slots_pool=128)
    g = torch.Generator().manual_seed(seed + 1)
    wo = ops.linear_weight_layout(torch.randn(hidden, hq * dv, generator=g) * (hq * dv) ** -0.5)
    attn = torch.randn(t, hq * dv, generator=g)
    wg, wu = (ops.linear_weight_layout(torch.randn(inter, hidden, generator=g) * hidden**-0.5) for _ in range(2))
    wd = ops.linear_weight_layout(torch.randn(hidden, inter, generator=g) * inter**-0.5)

    def calls():
        pools = (torch.zeros(128, hkv, d), torch.zeros(128, hkv, dv))
        q = attention_front(x, nw, 1e-6, w, num_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, cos=cos,
                            signed_sin=sin, value_scale=0.5, k_cache=pools[0], v_cache=pools[1], slots=slots)
        return (q, *pools, *attention_out(attn, wo, x, nw, 1e-6), dense_mlp(x, wg, wu, wd, residual=x))

    one, two = on_threads(1, calls), on_threads(2, calls)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    torch.testing.assert_close(one[-1], x + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
                               rtol=1e-4, atol=1e-4)
