"""CPU band attention: the fused sink path (torch's flash kernel + logsumexp gate) and unpadded
equal-length buckets vs the explicit-logits path and a dense N x N reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.encoders.test_vision import dense_band

from kernels import band_attention_ref as bar


def case(lens, num_kv, group, head_dim, seed, with_sinks=True):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, num_kv * group, head_dim, generator=g)
    k = torch.randn(n, num_kv, head_dim, generator=g)
    v = torch.randn(n, num_kv, head_dim, generator=g)
    sinks = torch.randn(num_kv * group, generator=g) if with_sinks else None
    return q, k, v, torch.tensor([0] + lens).cumsum(0), sinks


def run(q, k, v, cu, sinks, window, fused: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(bar, "FUSED_SINKS", fused)
    return bar.band_attention_ref(q, k, v, cu, scale=q.shape[-1] ** -0.5, window=window, sinks=sinks)


@settings(max_examples=30, deadline=None)
@given(lens=st.one_of(st.lists(st.integers(0, 300), min_size=1, max_size=4),
                      st.tuples(st.integers(1, 200), st.integers(1, 5)).map(lambda t: [t[0]] * t[1])),
       window=st.one_of(st.none(), st.integers(0, 40)), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 24]), seed=st.integers(0, 1000))
def test_fused_sinks_match_explicit_and_dense(lens, window, num_kv, group, head_dim, seed):
    q, k, v, cu, sinks = case(lens, num_kv, group, head_dim, seed)
    with pytest.MonkeyPatch.context() as mp:
        fused = run(q, k, v, cu, sinks, window, True, mp)
        explicit = run(q, k, v, cu, sinks, window, False, mp)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, dense_band(q, k, v, lens, head_dim ** -0.5, window, sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 16])
def test_video_frames_take_the_fused_path(window, monkeypatch):
    """Equal frames (a video group batch, 180 tokens each) never reach the explicit-logits path."""
    q, k, v, cu, sinks = case([180] * 3, 2, 2, 24, seed=0)

    def explicit(*_a, **_k):
        raise AssertionError("explicit sink path used")

    monkeypatch.setattr(bar, "_attend_with_sinks", explicit)
    out = run(q, k, v, cu, sinks, window, True, monkeypatch)
    torch.testing.assert_close(out, dense_band(q, k, v, [180] * 3, 24 ** -0.5, window, sinks), atol=1e-5, rtol=1e-5)


def test_equal_lengths_run_unpadded():
    """A bucket of one length (180 would pad to 192) needs neither a mask nor gathers."""
    chunks = bar._plan([180] * 4, None, (4, 2, 24, 24), False, "cpu")
    assert [(c.span, c.mask, c.q_run, c.k_run) for c in chunks] == [(180, None, 0, 0)]
    mixed = bar._plan([180, 170], None, (4, 2, 24, 24), False, "cpu")
    assert mixed[0].span == 192 and mixed[0].mask is not None
