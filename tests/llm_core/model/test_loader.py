"""Checkpoint loading: name checks, FP8 block scales, fused-qkv row orders, dtypes, tied weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from llm_core.model.config import AttentionSpec
from llm_core.model.fp8 import (
    FP8_DTYPE,
    dequantize_blockwise,
    dequantize_row_chunks,
    quantize_blockwise,
    quantize_row_chunks,
)
from llm_core.model.layers.fused_qkv import chunk_count, disk_rows_of_plain, plain_rows_of_disk
from llm_core.model.loader import expected_tensors, load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("loader") / "hf")


def _edit_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint dir, applying ``edit(tensors)`` to each shard's dict of tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    for path in src.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        edit(tensors)
        save_file(tensors, str(dst / path.name))
    return dst


def test_loads_every_parameter_from_hf_checkpoint(hf_dir):
    model = load_model(hf_dir)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        v = f.get_tensor("model.layers.1.self_attn.v_proj.weight")
        up3 = f.get_tensor("model.layers.2.mlp.experts.3.up_proj.weight")
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight[: q.shape[0]], q)
    assert torch.equal(attn.qkv_proj.weight[-v.shape[0] :], v)
    assert torch.equal(model.model.layers[2].mlp.experts.gate_up_proj[3, 32:], up3)
    assert torch.equal(model.model.layers[2].mlp.gate.e_score_correction_bias, bias)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.device.type == "cpu" and bool(torch.isfinite(t).all()), name


def test_missing_tensor_is_named(hf_dir, tmp_path):
    bad = _edit_checkpoint(hf_dir, tmp_path / "bad", lambda t: t.pop("model.layers.3.mlp.experts.5.down_proj.weight"))
    with pytest.raises(ValueError, match="missing tensors \\(1\\): model.layers.3.mlp.experts.5.down_proj.weight"):
        load_model(bad)


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.attention_sink_bias"] = torch.zeros(8)  # full layer: no sinks
        t["model.mtp.layers.0.enorm.weight"] = torch.ones(64)  # ignored prefix: fine

    bad = _edit_checkpoint(hf_dir, tmp_path / "bad", add)
    with pytest.raises(ValueError, match="unexpected tensors \\(1\\): model.layers.0.self_attn.attention_sink_bias"):
        load_model(bad)


def test_wrong_shape_is_named(hf_dir, tmp_path):
    def shrink(t):
        t["model.layers.4.self_attn.k_proj.weight"] = t["model.layers.4.self_attn.k_proj.weight"][:-24]

    bad = _edit_checkpoint(hf_dir, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match="model.layers.4.self_attn.k_proj.weight: shape \\(168, 64\\)"):
        load_model(bad)


def test_fp8_scale_errors_are_named(hf_dir, tmp_path):
    hub = write_hub_layout(hf_dir, tmp_path / "hub", fp8=True)
    name = "model.layers.0.mlp.up_proj.weight"

    def drop_scale_row(t):
        if name in t:
            t[name + "_scale_inv"] = t[name + "_scale_inv"][:-1]

    bad = _edit_checkpoint(hub, tmp_path / "bad_scale", drop_scale_row)
    with pytest.raises(ValueError, match=f"{name}: weight_scale_inv shape"):
        load_model(bad)
    no_scale = _edit_checkpoint(hub, tmp_path / "no_scale", lambda t: t.pop(name + "_scale_inv", None))
    with pytest.raises(ValueError, match=f"{name} is FP8 but the checkpoint has no"):
        load_model(no_scale)


def test_hub_fp8_layout_on_disk(hf_dir, tmp_path):
    """Hub files: fused qkv + chunk-padded scales (docs/model.md §2.1), fp32 router, bf16-kept o_proj, shards."""
    hub = write_hub_layout(hf_dir, tmp_path / "hub", fp8=True)
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["sliding_window_size"] == 7 and cfg["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0]
    index = json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    tensors = {}
    for path in hub.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    full_qkv, swa_qkv = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"
    assert tensors[full_qkv].shape == (352, 64) and tensors[full_qkv].dtype == FP8_DTYPE
    assert tensors[full_qkv + "_scale_inv"].shape == (24, 4)  # 4 chunks x ceil(88/16); global would be 22
    assert tensors[swa_qkv + "_scale_inv"].shape == (32, 4)  # 4 x 128 rows: chunked == global
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" not in tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.1.self_attn.q_proj.weight" not in tensors


def test_bf16_load_keeps_router_fp32(hf_dir):
    model = load_model(hf_dir, dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].self_attn.attention_sink_bias.dtype == torch.bfloat16


def test_tied_embeddings_share_storage(tmp_path):
    tied = build_tiny_hf_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in expected_tensors(model.config)


@settings(max_examples=40, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 3]),
    chunks=st.sampled_from([1, 2, 4]),
    order=st.sampled_from(["tp4_chunks", "kv_groups"]),
)
def test_fused_qkv_orders_are_inverse_permutations(kv, group, chunks, order):
    spec = AttentionSpec(kv * group, kv, 6, 4, 1e4, 2, True)
    try:
        c = chunk_count(spec, chunks, order)
    except ValueError as e:
        assert "do not split" in str(e) and kv % chunks
        return
    perm, inv = disk_rows_of_plain(spec, c), plain_rows_of_disk(spec, c)
    n = spec.q_size + spec.k_size + spec.v_size
    assert sorted(perm.tolist()) == list(range(n))
    assert torch.equal(perm[inv], torch.arange(n))
    # Chunk 0 on disk = first q heads, then first k heads, then first v heads.
    disk = torch.arange(n)[inv]  # plain row ids laid out in disk order
    qc, kc = spec.q_size // c, spec.k_size // c
    assert disk[:qc].tolist() == list(range(qc))
    assert disk[qc : qc + kc].tolist() == list(range(spec.q_size, spec.q_size + kc))


def test_row_orders_agree_when_chunks_equal_kv_heads():
    spec = AttentionSpec(16, 4, 8, 4, 1e4, 2, False)
    assert torch.equal(disk_rows_of_plain(spec, chunk_count(spec, 4, "tp4_chunks")),
                       disk_rows_of_plain(spec, chunk_count(spec, 4, "kv_groups")))
    with pytest.raises(ValueError, match="qkv_row_order 'rows'"):
        chunk_count(spec, 4, "rows")


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 70),
    bn=st.sampled_from([4, 16, 128]),
    chunks=st.sampled_from([1, 2, 4]),
)
def test_fp8_blockwise_round_trip(rows, cols, bn, chunks):
    n = rows * chunks * 5
    w = torch.randn(n, cols, generator=torch.Generator().manual_seed(n * cols))
    q, s = quantize_row_chunks(w, (bn, 16), chunks)
    assert s.shape == (chunks * -(-(n // chunks) // bn), -(-cols // 16))
    back = dequantize_row_chunks(q, s, (bn, 16), chunks)
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of its block's scale range
    assert float(((back - w).abs() / w.abs().clamp_min(1e-3)).median()) < 0.07
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(w, (bn, 16)), (bn, 16)),
                       dequantize_row_chunks(*quantize_blockwise(w, (bn, 16)), (bn, 16), 1))
