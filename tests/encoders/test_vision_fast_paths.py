"""The vision tower's per-grid geometry cache, the fused q/k rotary and row normalisation, each
against the construction it replaced (the same float32 arithmetic, so the same bits)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoders.image_processing import normalize_rows
from encoders.rotary import apply_rotary, vision_rotary
from encoders.vision.geometry_cache import GeometryCache, build_geometry
from encoders.vision.packing import VisionPackedBatch
from encoders.vision.tower import VisionTransformer
from kernels import ops
from samples.checkpoints.tiny_towers import init_random_, tiny_vision_config

TOWER = init_random_(VisionTransformer(tiny_vision_config()), seed=3).eval()


@torch.no_grad()
def per_call_forward(tower: VisionTransformer, rows: torch.Tensor, grids) -> torch.Tensor:
    """The tower's forward as it was before the cache: every index tensor and RoPE table built in
    the call, q and k rotated one tensor at a time."""
    cfg = tower.config
    batch = VisionPackedBatch.build(rows, grids, cfg.spatial_merge_size)
    x = tower.patch_embed(batch.rows)
    cos_row, sin_row = vision_rotary(batch.coords, cfg.head_dim, cfg.rope_theta)
    rope, order = {"row": (cos_row, sin_row)}, "row"
    for block, kind in zip(tower.blocks, cfg.block_kinds):
        need = "col" if kind == "col" else "row"
        if need != order:
            index = batch.col_index if need == "col" else batch.row_index
            x = batch.permute_units(x, index)
            order = need
            rope.setdefault(need, (batch.permute_units(cos_row, index), batch.permute_units(sin_row, index)))
        cos, sin = rope[order]
        a, n = block.attn, x.shape[0]
        q, k, v = a.qkv(block.norm1(x)).split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                                               a.num_kv_heads * a.head_dim], dim=-1)
        q = apply_rotary(q.reshape(n, a.num_heads, a.head_dim), cos, sin)
        k = apply_rotary(k.reshape(n, a.num_kv_heads, a.head_dim), cos, sin)
        out = ops.band_attention(q, k, v.reshape(n, a.num_kv_heads, a.head_dim), batch.cu_seqlens, scale=a.scale,
                                 window=None if kind == "full" else cfg.window, sinks=a.sinks)
        x = x + a.proj(out.reshape(n, -1))
        x = x + block.mlp(block.norm2(x))
    if order != "row":
        x = batch.permute_units(x, batch.row_index)
    return tower.merger(x)


grid_lists = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=3)


@settings(max_examples=15, deadline=None)
@given(grids=grid_lists, seed=st.integers(0, 100))
def test_cached_forward_equals_per_call_forward(grids, seed):
    grids = [(t, 2 * a, 2 * b) for t, a, b in grids]
    n = sum(t * h * w for t, h, w in grids)
    rows = torch.randn(n, TOWER.config.patch_dim, generator=torch.Generator().manual_seed(seed))
    want = per_call_forward(TOWER, rows, grids)
    first = torch.cat(TOWER(rows, grids))
    again = torch.cat(TOWER(rows, grids))  # a cache hit
    assert torch.equal(first, want) and torch.equal(again, want)


def test_geometry_equals_a_fresh_build_and_is_counted():
    cache = GeometryCache(merge=2, head_dim=16, theta=10000.0)
    grids = [(1, 4, 6), (2, 2, 4)]
    got = cache.get(grids, torch.device("cpu"))
    fresh = VisionPackedBatch.build(torch.zeros(24 + 16, 5), grids, merge=2)
    for name in ("cu_seqlens", "coords", "col_index", "row_index"):
        assert torch.equal(getattr(got.template, name), getattr(fresh, name)), name
    cos, sin = vision_rotary(fresh.coords, 16, 10000.0)
    assert torch.equal(got.rope("row")[0], cos) and torch.equal(got.rope("row")[1], sin)
    assert torch.equal(got.rope("col")[0], fresh.permute_units(cos, fresh.col_index))
    assert (cache.hits, cache.misses) == (0, 1)
    assert cache.get([tuple(g) for g in grids], torch.device("cpu")) is got
    assert (cache.hits, cache.misses) == (1, 1)
    cache.check_integrity()
    with pytest.raises(ValueError, match="describe 40 patches"):
        got.batch(torch.zeros(39, 5))


def test_geometry_cache_stays_within_its_byte_bound():
    one = build_geometry([(1, 4, 4)], 2, 16, 10000.0, torch.device("cpu")).nbytes
    cache = GeometryCache(merge=2, head_dim=16, theta=10000.0, max_bytes=3 * one)
    for w in range(2, 30, 2):  # every grid new, each at least as large as the first
        cache.get([(1, 4, w)], torch.device("cpu"))
        cache.check_integrity()
    assert 1 <= len(cache) <= 3 and cache.misses == 14
    big = cache.get([(1, 64, 64)], torch.device("cpu"))  # larger than the whole bound: served, not kept
    assert big.template.num_tokens == 4096 and all(g.template.num_tokens < 4096 for g in cache._entries.values())
    cache.check_integrity()
    cache.clear()
    assert len(cache) == 0
    cache.check_integrity()


def test_tower_counts_one_miss_per_video_grid():
    tower = init_random_(VisionTransformer(tiny_vision_config()), seed=4).eval()
    rows = torch.randn(4 * 6, tower.config.patch_dim)
    for _ in range(5):
        tower.encode_items([(rows, (1, 4, 6))])
    assert (tower.geometry.misses, tower.geometry.hits) == (1, 9)  # pack + forward_packed per call


def test_normalize_rows_rejects_rows_that_are_not_channel_blocks():
    with pytest.raises(ValueError, match="rows must be"):
        normalize_rows(torch.zeros(4, 1000))
    with pytest.raises(ValueError, match="rows must be"):
        normalize_rows(torch.zeros(3, 4, 3))
