"""Each rank's share of a checkpoint equals the matching slice of the whole model, for any tensor- /
expert-parallel size the tiny model's heads allow, in both layouts and with FP8 blocks (shard edges
fall inside 16-row blocks and inside the fused qkv's quantisation chunks). No process group is
needed: loading does no communication."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core.distributed.parallel_context import ParallelContext
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    hf = build_tiny_hf_checkpoint(root / "hf", seed=3)
    return {
        "hf": hf,
        "hub_fp8": write_hub_layout(hf, root / "hub_fp8", fp8=True),
        "hub_fp8_kv_groups": write_hub_layout(hf, root / "hub_kvg", fp8=True, qkv_row_order="kv_groups"),
    }


def _expected(full: dict[str, torch.Tensor], config, tp: int, ep: int, r: int) -> dict[str, torch.Tensor]:
    """The slice of every parameter rank r should hold, derived from the whole model's tensors."""
    out = {}
    vocab = config.vocab_size // tp
    v = slice(r * vocab, (r + 1) * vocab) if tp > 1 else slice(None)
    out["model.embed_tokens.weight"] = full["model.embed_tokens.weight"][v]
    out["lm_head.weight"] = full["lm_head.weight"][v]
    world = max(tp, ep)
    moe_tp, ep_rank = world // ep, r // (world // ep)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        spec = config.attn_spec(i)
        nq, g = spec.num_heads // tp, spec.num_heads // spec.num_kv_heads
        q0 = (r if tp > 1 else 0) * nq
        kvs = sorted({h // g for h in range(q0, q0 + nq)})  # the KV heads this rank's q heads use
        d, dv, qs, ks = spec.head_dim, spec.v_head_dim, spec.q_size, spec.k_size
        qkv = full[p + "self_attn.qkv_proj.weight"]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [qkv[q0 * d:(q0 + nq) * d]] + [qkv[qs + h * d: qs + (h + 1) * d] for h in kvs]
            + [qkv[qs + ks + h * dv: qs + ks + (h + 1) * dv] for h in kvs])
        out[p + "self_attn.o_proj.weight"] = full[p + "self_attn.o_proj.weight"][:, q0 * dv:(q0 + nq) * dv]
        if spec.has_sinks:
            out[p + "self_attn.attention_sink_bias"] = full[p + "self_attn.attention_sink_bias"][q0:q0 + nq]
        if config.mlp_kinds[i] == "dense":
            n = config.intermediate_size // tp
            rows = slice((r if tp > 1 else 0) * n, ((r if tp > 1 else 0) + 1) * n)
            out[p + "mlp.gate_proj.weight"] = full[p + "mlp.gate_proj.weight"][rows]
            out[p + "mlp.up_proj.weight"] = full[p + "mlp.up_proj.weight"][rows]
            out[p + "mlp.down_proj.weight"] = full[p + "mlp.down_proj.weight"][:, rows]
            continue
        ne, inter = config.num_experts // ep, config.moe_intermediate_size
        li = inter // moe_tp
        m = r % moe_tp
        gu = full[p + "mlp.experts.gate_up_proj"][ep_rank * ne:(ep_rank + 1) * ne]
        out[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [gu[:, m * li:(m + 1) * li], gu[:, inter + m * li: inter + (m + 1) * li]], dim=1)
        out[p + "mlp.experts.down_proj"] = full[p + "mlp.experts.down_proj"][
            ep_rank * ne:(ep_rank + 1) * ne, :, m * li:(m + 1) * li]
        out[p + "mlp.gate.weight"] = full[p + "mlp.gate.weight"]
    return out


@pytest.mark.parametrize("layout", ["hf", "hub_fp8", "hub_fp8_kv_groups"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (1, 8)])
def test_rank_shares_are_slices_of_the_whole(checkpoints, layout, tp, ep):
    kv_groups = layout.endswith("kv_groups")
    order = "kv_groups" if kv_groups else "tp4_chunks"
    whole = load_model(checkpoints[layout], qkv_row_order=order)
    full = dict(whole.named_parameters()) | dict(whole.named_buffers())
    # 8 ranks of a model with 4 full-attention KV heads: each KV head is held by two ranks
    for r in range(max(tp, ep)):
        ctx = ParallelContext(tp_size=tp, ep_size=ep, rank=r)
        shard = load_model(checkpoints[layout], qkv_row_order=order, parallel=ctx)
        got = dict(shard.named_parameters())
        for name, want in _expected(full, whole.config, tp, ep, r).items():
            assert torch.equal(got[name], want), f"tp={tp} ep={ep} rank {r}: {name}"
        assert sum(p.numel() for p in shard.parameters()) < sum(p.numel() for p in whole.parameters())


def test_kv_layout_is_the_rank_share(checkpoints):
    config = load_model(checkpoints["hf"]).config
    for tp, full_heads, swa_heads in ((1, 4, 8), (2, 2, 4), (8, 1, 1)):
        shard = load_model(checkpoints["hf"], parallel=ParallelContext(tp_size=tp, rank=tp - 1))
        layout = shard.kv_layout()
        assert (layout.full.num_kv_heads, layout.sliding.num_kv_heads) == (full_heads, swa_heads)
        assert layout.layer_kinds == config.layer_kinds


def test_shapes_that_do_not_split_are_refused(checkpoints):
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        load_model(checkpoints["hf"], parallel=ParallelContext(tp_size=3, rank=0))
    with pytest.raises(ValueError, match="tp must be 1 or the world size"):
        ParallelContext(tp_size=2, ep_size=4, rank=0)


def test_mtp_layers_shard_like_a_sliding_layer_and_none_need_no_split(checkpoints, tmp_path):
    """A checkpoint's MTP layers under TP=2: each rank holds its heads and MLP slice (the tensors a
    whole load holds, sliced); with no MTP layers the MTP plan asks nothing of intermediate_size
    (a model without dense layers need not split it)."""
    import dataclasses

    from llm_core.model.loader import expected_mtp_tensors

    ck = build_tiny_hf_checkpoint(tmp_path / "mtp", seed=3, mtp_layers=1)
    whole = dict(load_model(ck).model.mtp.named_parameters())
    for r in range(2):
        got = dict(load_model(ck, parallel=ParallelContext(tp_size=2, rank=r)).model.mtp.named_parameters())
        n = whole["layers.0.mlp.gate_proj.weight"].shape[0] // 2
        assert torch.equal(got["layers.0.mlp.gate_proj.weight"], whole["layers.0.mlp.gate_proj.weight"][r * n:(r + 1) * n])
        assert torch.equal(got["layers.0.mlp.down_proj.weight"], whole["layers.0.mlp.down_proj.weight"][:, r * n:(r + 1) * n])
        assert torch.equal(got["layers.0.eh_proj.weight"], whole["layers.0.eh_proj.weight"])  # whole on every rank
        assert got["layers.0.self_attn.qkv_proj.weight"].shape[0] == whole["layers.0.self_attn.qkv_proj.weight"].shape[0] // 2
    config = dataclasses.replace(load_model(checkpoints["hf"]).config, intermediate_size=127)
    assert expected_mtp_tensors(config, 0, parallel=ParallelContext(tp_size=2, rank=0)) == {}
    with pytest.raises(ValueError, match="intermediate_size"):
        expected_mtp_tensors(config, 1, parallel=ParallelContext(tp_size=2, rank=0))
