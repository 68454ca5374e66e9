"""Vision tower: equivalence against a dense raster-order reference written here, packing invariants,
preprocessing rules, checkpoint round trip, config errors, and the band-attention reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from encoders.config import VisionConfig
from encoders.image_processing import (ImageProcessingConfig, normalize, patchify, preprocess_image,
                                       resize_frames, smart_resize)
from encoders.vision.packing import VisionPackedBatch
from samples.checkpoints.tiny_towers import init_random_, tiny_vision_config
from encoders.vision.tower import VisionTransformer
from encoders.weights import load_vision_tower, read_prefixed, save_modules
from kernels.band_attention_ref import band_attention_ref


def make_tower(seed: int = 0, **overrides) -> VisionTransformer:
    return init_random_(VisionTransformer(tiny_vision_config(**overrides)), seed).eval()


# ---------------------------------------------------------------------------------------------------
# Dense reference: every token in (t, h, w) raster order, orders and windows from explicit formulas.
# ---------------------------------------------------------------------------------------------------

def order_rank(h: torch.Tensor, w: torch.Tensor, gh: int, gw: int, m: int, column: bool) -> torch.Tensor:
    """Position of patch (h, w) inside its frame in row (merge-unit-major) or column unit order."""
    inside = (h % m) * m + (w % m)
    if column:
        unit = (w // m) * (gh // m) + h // m
    else:
        unit = (h // m) * (gw // m) + w // m
    return unit * m * m + inside


def dense_attention(x, attn, cos, sin, mask, sinks):
    cfg_h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    n = x.shape[0]
    q, k, v = attn.qkv(x).split([cfg_h * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(n, cfg_h, d), k.view(n, kv, d), v.view(n, kv, d)

    def rope(t):
        half = d // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos[:, None] + rot * sin[:, None]

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(cfg_h // kv, 1)
    v = v.repeat_interleave(cfg_h // kv, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, n, 1)], -1)
    probs = logits.softmax(-1)[..., :n]
    return attn.proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))


@torch.no_grad()
def dense_reference(tower: VisionTransformer, frames: torch.Tensor) -> torch.Tensor:
    """Normalised frames [2t, C, H, W] -> merged embeddings in (t, h/m, w/m) order."""
    cfg = tower.config
    m, p = cfg.spatial_merge_size, cfg.patch_size
    conv = F.conv3d(frames.permute(1, 0, 2, 3)[None], tower.patch_embed.proj.weight,
                    stride=(cfg.temporal_patch_size, p, p))[0]  # [hidden, t, gh, gw]
    _, t, gh, gw = conv.shape
    x = conv.permute(1, 2, 3, 0).reshape(-1, cfg.hidden_size)
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
    tt, hh, ww = tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)
    nf = cfg.head_dim // 4
    inv = 1.0 / cfg.rope_theta ** (torch.arange(nf) * 2.0 / (cfg.head_dim // 2))
    ang = torch.cat([hh[:, None] * inv, ww[:, None] * inv], -1)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    same_frame = tt[:, None] == tt[None, :]
    for block, kind in zip(tower.blocks, cfg.block_kinds):
        mask = same_frame.clone()
        if kind != "full":
            r = order_rank(hh, ww, gh, gw, m, column=(kind == "col"))
            mask &= (r[:, None] - r[None, :]).abs() <= cfg.window
        h = block.norm1(x)
        x = x + dense_attention(h, block.attn, cos, sin, mask, block.attn.sinks)
        x = x + block.mlp(block.norm2(x))
    x = tower.merger.ln_q(x).view(t, gh // m, m, gw // m, m, -1).permute(0, 1, 3, 2, 4, 5)
    return tower.merger.mlp(x.reshape(t * (gh // m) * (gw // m), -1))


def random_frames(t: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return normalize(torch.rand(t, 3, h, w, generator=g) * 255)


@pytest.mark.parametrize("t,h,w", [(2, 64, 96), (2, 160, 32), (4, 32, 32), (2, 128, 128)])
def test_tower_matches_dense_reference(t, h, w):
    tower = make_tower()
    frames = random_frames(t, h, w, seed=h + w)
    rows, grid = patchify(frames)
    ours = tower(rows, [grid])[0]
    ref = dense_reference(tower, frames)
    assert ours.shape == ref.shape == (grid[0] * grid[1] * grid[2] // 4, 48)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_window_matters_and_sinks_matter():
    """Guards the reference test against a vacuous pass: band and sinks change the output."""
    frames = random_frames(2, 128, 128, seed=3)
    rows, grid = patchify(frames)
    base = make_tower()(rows, [grid])[0]
    wide = make_tower(window=10_000)(rows, [grid])[0]
    no_sink = make_tower(use_sink=False)
    assert (base - wide).abs().max() > 1e-3
    assert not any(name.endswith("sinks") for name, _ in no_sink.named_parameters())


def test_packed_batch_equals_one_by_one():
    tower = make_tower(seed=1)
    cfg = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=192 * 192)
    gen = torch.Generator().manual_seed(0)
    sizes = [(40, 40), (300, 50), (97, 131), (256, 200), (20, 500), (64, 64)]
    items = [preprocess_image(torch.rand(3, h, w, generator=gen) * 255, cfg) for h, w in sizes]
    assert any(g[1] * g[2] < tower.config.window for _, g in items)  # fewer tokens than the window
    batched = tower.encode_items(items)
    for (rows, grid), out in zip(items, batched):
        alone = tower(rows, [grid])[0]
        assert out.shape == (grid[1] * grid[2] // 4, 48)
        torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(grids=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=4))
def test_column_permutation_round_trip(grids):
    grids = [(t, 2 * a, 2 * b) for t, a, b in grids]
    n = sum(t * h * w for t, h, w in grids)
    batch = VisionPackedBatch.build(torch.zeros(n, 1), grids, merge=2)
    x = torch.randn(n, 3)
    col = batch.permute_units(x, batch.col_index)
    assert torch.equal(batch.permute_units(col, batch.row_index), x)
    # In column order the units of a frame are enumerated w-block outer, h-block inner.
    coords_col = batch.permute_units(batch.coords, batch.col_index)
    cu = batch.cu_seqlens.tolist()
    frame_grids = [(h, w) for t, h, w in grids for _ in range(t)]
    for (h, w), a, b in zip(frame_grids, cu, cu[1:]):
        c = coords_col[a:b]
        expected = order_rank(c[:, 0], c[:, 1], h, w, 2, column=True)
        assert torch.equal(expected, torch.arange(b - a))


def test_patch_embed_matmul_equals_conv3d():
    tower = make_tower()
    frames = random_frames(2, 64, 96, seed=7)
    rows, (t, gh, gw) = patchify(frames)
    conv = F.conv3d(frames.permute(1, 0, 2, 3)[None], tower.patch_embed.proj.weight, stride=(2, 16, 16))[0]
    raster = conv.permute(1, 2, 3, 0).reshape(t, gh // 2, 2, gw // 2, 2, -1).permute(0, 1, 3, 2, 4, 5)
    torch.testing.assert_close(tower.patch_embed(rows), raster.reshape(t * gh * gw, -1), atol=1e-5, rtol=1e-5)


def test_image_is_duplicated_in_time():
    frame = random_frames(1, 64, 64, seed=1)
    rows1, grid1 = patchify(frame)
    rows2, grid2 = patchify(torch.cat([frame, frame]))
    assert grid1 == grid2 == (1, 4, 4)
    assert torch.equal(rows1, rows2)


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 6000), w=st.integers(1, 6000))
def test_smart_resize_rules(h, w):
    factor, lo, hi = 32, 8192, 1 << 20
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(h, w, factor, lo, hi)
        return
    nh, nw = smart_resize(h, w, factor, lo, hi)
    assert nh % factor == 0 and nw % factor == 0 and nh >= factor and nw >= factor
    assert nh * nw <= hi or min(nh, nw) == factor  # only a one-unit-thin strip may exceed
    assert nh * nw >= lo
    if min(nh, nw) > factor:
        # One scale s for both sides, each side off by less than one unit: |n - s*x| < factor.
        assert abs(nh / h - nw / w) <= factor / h + factor / w + 1 / h + 1 / w


def test_smart_resize_examples_and_errors():
    assert smart_resize(224, 224, 32, 8192, 8388608) == (224, 224)
    assert smart_resize(10, 10, 32, 1, 8388608) == (32, 32)  # tiny image grows to one unit
    assert smart_resize(4000, 3000, 32, 8192, 1 << 20) == (1152, 864)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 32, 8192, 1 << 20)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10, 32, 8192, 1 << 20)
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(100, 100, 32, 1 << 21, 1 << 20)


def test_preprocess_matches_manual_pipeline():
    image = torch.rand(3, 90, 170) * 255
    cfg = ImageProcessingConfig(min_pixels=4096, max_pixels=128 * 128)
    rows, grid = preprocess_image(image, cfg)
    h, w = smart_resize(90, 170, 32, 4096, 128 * 128)
    manual = normalize(resize_frames(image[None], h, w))
    assert grid == (1, h // 16, w // 16)
    assert torch.equal(rows, patchify(manual)[0])
    with pytest.raises(ValueError, match="multiple of patch_size"):
        patchify(torch.zeros(1, 3, 48, 64))


def test_checkpoint_round_trip(tmp_path):
    tower = make_tower(seed=5)
    path = tmp_path / "vision.safetensors"
    save_modules(path, {"visual.": tower})
    names = set(read_prefixed(path, "visual.").keys())
    assert {"patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.1.attn.sinks",
            "blocks.0.mlp.gate_proj.bias", "merger.ln_q.weight", "merger.mlp.0.weight",
            "merger.mlp.2.weight"} <= names
    assert "blocks.0.attn.sinks" not in names and "merger.mlp.0.bias" not in names
    assert read_prefixed(path, "visual.")["patch_embed.proj.weight"].shape == (64, 3, 2, 16, 16)
    loaded = load_vision_tower(tower.config, path)
    rows, grid = patchify(random_frames(2, 64, 64, seed=2))
    torch.testing.assert_close(loaded(rows, [grid])[0], tower(rows, [grid])[0], atol=0, rtol=0)
    with pytest.raises(KeyError, match="missing"):
        load_vision_tower(tiny_vision_config(depth=6, vit_window_attn_types=(-1, 0, 1, -1, 1, 0)), path)


def test_bad_configs_and_inputs():
    with pytest.raises(ValueError, match="not divisible"):
        tiny_vision_config(num_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="unknown attention type"):
        tiny_vision_config(vit_window_attn_types=(-1, 0, 2, -1, 1))
    with pytest.raises(ValueError, match="disagree"):
        tiny_vision_config(fullatt_block_indexes=(0,))
    with pytest.raises(ValueError, match="entries for depth"):
        tiny_vision_config(depth=4)
    tower = make_tower()
    with pytest.raises(ValueError, match="does not divide the patch grid"):
        tower(torch.zeros(3 * 6, 1536), [(1, 3, 6)])
    with pytest.raises(ValueError, match="describe"):
        tower(torch.zeros(10, 1536), [(1, 2, 4)])


def test_from_dict_reads_hub_config():
    hub = {"depth": 28, "hidden_size": 1280, "intermediate_size": 4608, "num_heads": 32, "num_key_value_heads": 8,
           "num_query_groups": 4, "hidden_act": "silu", "in_chans": 3, "patch_size": 16, "spatial_patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
           "fullatt_block_indexes": [0, 9, 18, 27],
           "vit_window_attn_types": [-1, 0, 0, 0, 0, 1, 1, 1, 1] * 3 + [-1],
           "visual_token_window_size": 64, "window_size": 128, "use_sink": True, "tokens_per_second": 2}
    hub["vit_window_attn_types"][9] = hub["vit_window_attn_types"][18] = -1
    cfg = VisionConfig.from_dict(hub)
    assert cfg == VisionConfig()  # our defaults are the real checkpoint
    assert cfg.head_dim == 64 and cfg.qkv_size == 3072 and cfg.patch_dim == 1536
    assert [b for b in range(28) if cfg.has_sinks(b)] == [b for b in range(28) if b not in (0, 9, 18, 27)]
    assert VisionConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------------------------------
# Band attention reference vs a dense N x N mask.
# ---------------------------------------------------------------------------------------------------

def dense_band(q, k, v, lens, scale, window, sinks):
    n, hq, _ = q.shape
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    i = torch.arange(n)
    mask = seg[:, None] == seg[None, :]
    if window is not None:
        mask &= (i[:, None] - i[None, :]).abs() <= window
    g = hq // k.shape[1]
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, n, 1)], -1)
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :n], v.repeat_interleave(g, 1))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 400), min_size=1, max_size=4), window=st.one_of(st.none(), st.integers(0, 70)),
       use_sinks=st.booleans(), group=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_band_attention_matches_dense(lens, window, use_sinks, group, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, 4, 8, generator=g)
    k = torch.randn(n, 4 // group, 8, generator=g)
    v = torch.randn(n, 4 // group, 6, generator=g)
    sinks = torch.randn(4, generator=g) if use_sinks else None
    cu = torch.tensor([0] + lens).cumsum(0)
    ours = band_attention_ref(q, k, v, cu, scale=0.35, window=window, sinks=sinks)
    torch.testing.assert_close(ours, dense_band(q, k, v, lens, 0.35, window, sinks), atol=1e-5, rtol=1e-5)


def test_band_attention_rejects_bad_input():
    q = torch.randn(10, 4, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        band_attention_ref(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), torch.tensor([0, 10]), scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        band_attention_ref(q, q, q, torch.tensor([0, 7]), scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        band_attention_ref(q, q, q, torch.tensor([0, 10]), scale=1.0, sinks=torch.zeros(3))


def test_real_config_parameter_names_and_shapes():
    """The full-size tower (built on meta, no memory) has exactly the checkpoint's tensors (docs/model.md §2.3)."""
    with torch.device("meta"):
        tower = VisionTransformer(VisionConfig())
    shapes = {name: tuple(t.shape) for name, t in tower.state_dict().items()}
    expected = {"patch_embed.proj.weight": (1280, 3, 2, 16, 16), "merger.ln_q.weight": (1280,),
                "merger.mlp.0.weight": (5120, 5120), "merger.mlp.2.weight": (4096, 5120)}
    for b in range(28):
        p = f"blocks.{b}."
        expected.update({p + "norm1.weight": (1280,), p + "norm2.weight": (1280,),
                         p + "attn.qkv.weight": (3072, 1280), p + "attn.qkv.bias": (3072,),
                         p + "attn.proj.weight": (1280, 2048), p + "attn.proj.bias": (1280,),
                         p + "mlp.gate_proj.weight": (4608, 1280), p + "mlp.gate_proj.bias": (4608,),
                         p + "mlp.up_proj.weight": (4608, 1280), p + "mlp.up_proj.bias": (4608,),
                         p + "mlp.down_proj.weight": (1280, 4608), p + "mlp.down_proj.bias": (1280,)})
        if b not in (0, 9, 18, 27):
            expected[p + "attn.sinks"] = (32,)
    assert shapes == expected
