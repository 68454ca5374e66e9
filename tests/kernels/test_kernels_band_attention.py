"""Triton varlen band attention (vision ViT: ±window band, sinks, GQA) vs ``band_attention_ref``.
On CPU the kernel tests run in a TRITON_INTERPRET=1 child (see test_kernels_support)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.kernels.test_kernels_support import DEVICE, interpreter_rerun, kernel_test, run_under_interpreter

from kernels import ops
from kernels.band_attention_ref import band_attention_ref
from kernels.band_attention_triton import band_attention_triton


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


def make_case(seed: int, seg_lens: list[int], num_heads: int, num_kv: int, head_dim: int, v_dim: int,
              with_sinks: bool):
    gen = torch.Generator().manual_seed(seed)
    n = sum(seg_lens)
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k = torch.randn(n, num_kv, head_dim, generator=gen)
    v = torch.randn(n, num_kv, v_dim, generator=gen)
    cu = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    sinks = torch.randn(num_heads, generator=gen) if with_sinks else None
    return q, k, v, cu, sinks


def check(case, *, window: int | None, scale: float = 0.25, block_n: int = 64) -> None:
    q, k, v, cu, sinks = case
    ref = band_attention_ref(q, k, v, cu, scale=scale, window=window, sinks=sinks)
    out = band_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu, scale=scale, window=window,
                                sinks=None if sinks is None else sinks.to(DEVICE), block_n=block_n)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@kernel_test
@settings(max_examples=25, deadline=None)
@given(seg_lens=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
       num_kv=st.integers(1, 2), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([8, 24]),
       v_dim=st.sampled_from([8, 20]), window=st.one_of(st.none(), st.integers(0, 12)),
       with_sinks=st.booleans(), block_n=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_matches_reference(seg_lens, num_kv, group, head_dim, v_dim, window, with_sinks, block_n, seed) -> None:
    """Empty and single-token segments, windows 0 (self only) to wider than a segment, GQA 1/3/4."""
    case = make_case(seed, seg_lens, num_kv * group, num_kv, head_dim, v_dim, with_sinks)
    check(case, window=window, block_n=block_n)


@kernel_test
def test_vision_geometry_through_ops() -> None:
    # ViT heads: 64-dim, GQA 4:1, band ±5 over two "frames" of different sizes, with sinks.
    q, k, v, cu, sinks = make_case(3, [37, 70], 8, 2, 64, 64, True)
    ref = band_attention_ref(q, k, v, cu, scale=0.125, window=5, sinks=sinks)
    out = ops.band_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), scale=0.125, window=5,
                             sinks=sinks.to(DEVICE))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@kernel_test
def test_attention_never_crosses_segments() -> None:
    # Changing the keys/values of segment 1 must leave segment 0's output bit-identical.
    q, k, v, cu, sinks = make_case(4, [9, 7], 2, 1, 8, 8, False)
    first = band_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu, scale=0.5).cpu()
    k2, v2 = k.clone(), v.clone()
    k2[9:] = torch.randn(7, 1, 8)
    v2[9:] = float("nan")
    second = band_attention_triton(q.to(DEVICE), k2.to(DEVICE), v2.to(DEVICE), cu, scale=0.5).cpu()
    assert torch.equal(first[:9], second[:9])


def test_wrapper_rejects_bad_inputs() -> None:
    q, k, v, cu, _ = make_case(0, [3, 2], 2, 1, 8, 8, False)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        band_attention_triton(q, k, v, torch.tensor([0, 3, 4]), scale=1.0)
    with pytest.raises(ValueError, match="rows"):
        band_attention_triton(q, k[:4], v[:4], cu, scale=1.0)
    with pytest.raises(ValueError, match="window"):
        band_attention_triton(q, k, v, cu, scale=1.0, window=-1)
    with pytest.raises(ValueError, match="sinks"):
        band_attention_triton(q, k, v, cu, scale=1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="1-D int"):
        band_attention_triton(q, k, v, cu.float(), scale=1.0)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    q, k, v, cu, sinks = (t.to(dtype) if t is not None and t.is_floating_point() else t
                          for t in make_case(5, [30, 19], 4, 1, 24, 24, True))
    ref = band_attention_ref(q.float(), k.float(), v.float(), cu, scale=0.2, window=7, sinks=sinks.float())
    out = band_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu, scale=0.2, window=7,
                                sinks=sinks.to(DEVICE), block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)
