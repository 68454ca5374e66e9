"""Routed experts kept in block-FP8 (``load_model(fp8_experts=True)``; kernels/block_fp8.py): an FP8
checkpoint's expert values and block factors are placed as stored, a float checkpoint's are quantised
at load, each rank holds its slice, and the model computes what it computes on the same values
dequantised at load (on CPU the stacks are dequantised per call)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kernels.block_fp8 import FP8_DTYPE, BlockFP8, gpu_reads_e4m3
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.model.loader import DEFAULT_FP8_BLOCK, load_model
from tests.llm_core.model.test_model_equivalence import Runner
from samples.checkpoints.tiny_text import TINY_FP8_BLOCK, build_tiny_hf_checkpoint, write_hub_layout

pytestmark = pytest.mark.usefixtures("one_thread")
MOE_LAYER = 2  # a MoE layer of the tiny model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_experts")
    hf = build_tiny_hf_checkpoint(root / "hf", seed=5)
    return {"hf": hf, "hub_fp8": write_hub_layout(hf, root / "hub_fp8", fp8=True)}


def stacks(model) -> tuple[BlockFP8, BlockFP8]:
    return model.model.layers[MOE_LAYER].mlp.experts.operands()


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt, in two chunks (paged KV)."""
    return Runner(model).run_chunks(torch.tensor(ids), [len(ids) // 2, len(ids) - len(ids) // 2])


def test_fp8_checkpoint_experts_placed_as_stored(checkpoints):
    model = load_model(checkpoints["hub_fp8"], fp8_experts=True)
    gu, dn = stacks(model)
    assert gu.values.dtype == FP8_DTYPE and gu.block == TINY_FP8_BLOCK and gu.groups == 2
    assert model.config.expert_fp8_block == TINY_FP8_BLOCK
    p = f"model.layers.{MOE_LAYER}.mlp.experts.3."
    with safe_open(str(checkpoints["hub_fp8"] / "model-experts.safetensors"), framework="pt") as f:
        up, up_s = f.get_tensor(p + "up_proj.weight"), f.get_tensor(p + "up_proj.weight_scale_inv")
        down, down_s = f.get_tensor(p + "down_proj.weight"), f.get_tensor(p + "down_proj.weight_scale_inv")
    inter = up.shape[0]
    assert torch.equal(gu.values[3, inter:].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(gu.scale_inv[3, gu.group_scale_rows:], up_s)
    assert torch.equal(dn.values[3].view(torch.uint8), down.view(torch.uint8)) and torch.equal(dn.scale_inv[3], down_s)
    # the same values as the default load dequantises, everything else unchanged
    plain = load_model(checkpoints["hub_fp8"])
    want = plain.model.layers[MOE_LAYER].mlp.experts
    assert torch.equal(gu.dequantize(), want.gate_up_proj) and torch.equal(dn.dequantize(), want.down_proj)
    assert torch.equal(model.lm_head.weight, plain.lm_head.weight)


def test_fp8_experts_model_matches_dequantised_load(checkpoints):
    ids = [5, 17, 300, 42, 9, 77, 120, 3, 250, 11]
    got = logits_of(load_model(checkpoints["hub_fp8"], fp8_experts=True), ids)
    want = logits_of(load_model(checkpoints["hub_fp8"]), ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_float_checkpoint_quantised_at_load(checkpoints):
    model = load_model(checkpoints["hf"], fp8_experts=True)
    gu, dn = stacks(model)
    assert gu.block == DEFAULT_FP8_BLOCK and dn.values.dtype == FP8_DTYPE
    whole = load_model(checkpoints["hf"]).model.layers[MOE_LAYER].mlp.experts
    q = BlockFP8.quantize(whole.gate_up_proj, DEFAULT_FP8_BLOCK, groups=2)
    assert torch.equal(gu.values.view(torch.uint8), q.values.view(torch.uint8)) and torch.equal(gu.scale_inv, q.scale_inv)
    ids = [5, 17, 300, 42, 9, 77]
    got, want = logits_of(model, ids), logits_of(load_model(checkpoints["hf"]), ids)
    assert (got - want).norm() / want.norm() < 0.05  # e4m3 rounding of the experts only


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_rank_shares(checkpoints, tp, ep):
    """tp 2: each rank's 16 intermediate rows start on a 16-row block edge -> the stored values and
    factors; tp 4: 8-row slices cut blocks -> quantised again on the rank's own slice (close, not
    equal); ep: whole experts as stored."""
    whole_gu, whole_dn = (s.dequantize() for s in stacks(load_model(checkpoints["hub_fp8"], fp8_experts=True)))
    world, inter = max(tp, ep), whole_dn.shape[-1]
    moe_tp = world // ep
    li, ne = inter // moe_tp, whole_gu.shape[0] // ep
    for r in range(world):
        shard = load_model(checkpoints["hub_fp8"], fp8_experts=True, parallel=ParallelContext(tp_size=tp, ep_size=ep, rank=r))
        gu, dn = (s.dequantize() for s in stacks(shard))
        m, e0 = r % moe_tp, (r // moe_tp) * ne
        want_gu = torch.cat([whole_gu[e0:e0 + ne, m * li:(m + 1) * li],
                             whole_gu[e0:e0 + ne, inter + m * li:inter + (m + 1) * li]], dim=1)
        want_dn = whole_dn[e0:e0 + ne, :, m * li:(m + 1) * li]
        if li % TINY_FP8_BLOCK[0] == 0:
            assert torch.equal(gu, want_gu) and torch.equal(dn, want_dn), f"rank {r}"
        else:
            torch.testing.assert_close(gu, want_gu, atol=want_gu.abs().max().item() * 2**-4, rtol=0)
            torch.testing.assert_close(dn, want_dn, atol=want_dn.abs().max().item() * 2**-4, rtol=0)


@pytest.mark.parametrize("capability, reads", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                               ((10, 0), True)])
def test_e4m3_needs_sm89_and_an_older_gpu_is_refused_by_name(checkpoints, monkeypatch, capability, reads):
    """Triton reads e4m3 on Ada / Hopper and newer only: the default (None) keeps the experts in FP8
    there and dequantises them at load on an A100 / A10 (as before FP8 experts); asking for them
    there is an error naming the GPU, before any weight is read."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert gpu_reads_e4m3("cuda:0") is reads and gpu_reads_e4m3("cpu") is None
    if not reads:
        with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*has " + ".".join(map(str, capability))):
            load_model(checkpoints["hub_fp8"], device="cuda:0", fp8_experts=True)
