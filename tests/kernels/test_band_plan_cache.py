"""The band-attention plan cache is bounded by bytes, not only by count: a plan holds index tensors
and, with sinks on CPU, an fp32 bias per query block, so a few big images must not pin memory after
their requests."""

from __future__ import annotations

import torch

from kernels import band_attention_ref as bar


def _attend(seg_lens: list[int], window: int | None, sinks: bool) -> torch.Tensor:
    n = sum(seg_lens)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist())
    return bar.band_attention_ref(q, k, v, cu, scale=0.25, window=window,
                                  sinks=torch.zeros(4) if sinks else None)


def _held_bytes() -> int:
    return sum(bar._plan_bytes(plan) for plan, _ in bar._plan_cache.values())


def test_the_cache_holds_no_more_bytes_than_its_budget(monkeypatch) -> None:
    monkeypatch.setattr(bar, "_plan_cache", type(bar._plan_cache)())
    monkeypatch.setattr(bar, "_plan_cache_bytes", 0)
    monkeypatch.setattr(bar, "_PLAN_CACHE_BYTES", 2 << 20)
    for n in range(1000, 1016):  # sixteen geometries, each plan ~0.6 MB with sinks
        _attend([n], window=8, sinks=True)
        assert _held_bytes() <= 2 << 20
        assert bar._plan_cache_bytes == _held_bytes()
    assert 0 < len(bar._plan_cache) < 16


def test_a_plan_over_the_budget_is_used_but_not_kept(monkeypatch) -> None:
    monkeypatch.setattr(bar, "_plan_cache", type(bar._plan_cache)())
    monkeypatch.setattr(bar, "_plan_cache_bytes", 0)
    monkeypatch.setattr(bar, "_PLAN_CACHE_BYTES", 64 << 10)
    small = _attend([40, 24], window=None, sinks=False)
    assert len(bar._plan_cache) == 1
    kept = next(iter(bar._plan_cache))
    big = _attend([6000], window=8, sinks=True)
    assert torch.isfinite(big).all() and torch.isfinite(small).all()
    assert list(bar._plan_cache) == [kept]  # the big plan was not kept, and evicted nothing
    # the kept plan is reused: same chunk objects on the next call of that geometry
    plan = bar._plan_cache[kept][0]
    _attend([40, 24], window=None, sinks=False)
    assert bar._plan_cache[kept][0] is plan
