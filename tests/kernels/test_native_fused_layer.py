"""A decoder layer of an all-decode step in one C call (kernels/native/fused_layer.c) decodes the same
tokens with the same logprobs, bit for bit, as the layer run part by part (each part its own C call),
at batch 1 and 8 on the tiny model (dense and MoE layers, full and sliding, sinks); it served the
decode steps' layers; a routing tie still defers to the torch router; a slot outside the pool raises.
So does the last layer of a short prefill step, whose output only its logits rows need (the same call
with picked rows: FusedDecode.run_rows), with one prompt or several in a step; picked rows out of
order or outside the step leave the step to the part-by-part path."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.attention_plan import AttentionPlan
from kernels.native import build, fused_layer
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.layers.fused_decode import FusedDecode
from llm_core.model.layers.moe import SparseMoE
from llm_core.model.loader import load_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(fused_layer._lib() is None, reason="no C compiler: the torch path serves")]


def _generate(ckpt, prompts, *, tie_router: bool = False, max_tokens: int = 12):
    cfg = EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=8,
                       max_num_batched_tokens=256)
    model = load_model(ckpt, dtype=torch.float32)
    if tie_router:  # every expert scores the same: each token's choice is ambiguous
        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.gate.weight.data.zero_()
                m.gate.e_score_correction_bias.zero_()
    llm = LLM.from_engine(LLMEngine(model, cfg))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


def _record_picked(monkeypatch) -> list:
    """The logits rows' plans taken from the step's plan (AttentionPlan.picked; None: not taken), as the
    engine asks for them."""
    derived = []
    real_picked = AttentionPlan.picked

    def picked_plan(self, rows):
        derived.append(real_picked(self, rows))
        return derived[-1]

    monkeypatch.setattr(AttentionPlan, "picked", picked_plan)
    return derived


def _prompts(batch):
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in torch.randint(5, 30, (batch,), generator=g)]


@pytest.mark.parametrize("batch,tie_router", [(1, False), (8, False), (8, True)])
def test_same_tokens_and_logprobs_as_the_layer_part_by_part(ckpt, monkeypatch, batch, tie_router):
    monkeypatch.setattr(build, "_enabled", build.enabled())  # the engines flip the process switch: restore it
    served, ties = [], []
    real_run, real_call = FusedDecode.run, fused_layer.decode_layer

    def counted_call(*args, **kwargs):
        got = real_call(*args, **kwargs)
        ties.append(got is not None and got[2] is None)
        return got

    def counted(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(FusedDecode, "run", counted)
    monkeypatch.setattr(fused_layer, "decode_layer", counted_call)
    prompts = _prompts(batch)
    fused = _generate(ckpt, prompts, tie_router=tie_router)
    assert sum(served) >= 11  # the decode steps' layers (but the last: logits rows only) went through it
    assert any(ties) == tie_router  # tied routers: the MoE layers handed h to the torch router
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, **k: None)
    parts = _generate(ckpt, prompts, tie_router=tie_router)
    for (toks, lps), (rtoks, rlps) in zip(fused, parts):
        assert toks == rtoks
        assert lps == rlps  # bit for bit: the same kernels on the same inputs


@pytest.mark.parametrize("lengths", [(23,), (7, 12, 20)])
def test_a_short_prefills_logits_rows_as_one_call_give_the_same_bits(ckpt, monkeypatch, lengths):
    monkeypatch.setattr(build, "_enabled", build.enabled())
    picked = []
    real_rows = FusedDecode.run_rows

    def counted(self, x, batch, k_cache, v_cache, rows):
        out = real_rows(self, x, batch, k_cache, v_cache, rows)
        if out is not None:
            picked.append((x.shape[0], rows.tolist()))
        return out

    monkeypatch.setattr(FusedDecode, "run_rows", counted)
    derived = _record_picked(monkeypatch)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    # one generated token: the prefill step's logits alone (the decode steps would not pick rows)
    fused = _generate(ckpt, prompts, max_tokens=1)
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert (sum(lengths), ends.tolist()) in picked  # the whole prompt step, its last rows picked
    assert any(plan is not None for plan in derived)
    monkeypatch.setattr(FusedDecode, "run_rows", lambda self, *a, **k: None)
    parts = _generate(ckpt, prompts, max_tokens=1)
    assert fused == parts  # tokens and logprobs, bit for bit


@pytest.mark.parametrize("lengths", [(90,), (70, 15, 40)])
def test_a_long_prefills_logits_rows_attend_through_the_picked_plan_with_the_same_bits(ckpt, monkeypatch, lengths):
    """Past the one-call layer's rows the last layer runs part by part (Attention.attend_rows): its
    logits rows attend through the plan picked from the step's plan, and give the bits they give
    through a plan built over ForwardBatch.logits_batch() (AttentionPlan.picked switched off)."""
    monkeypatch.setattr(build, "_enabled", build.enabled())
    derived = _record_picked(monkeypatch)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    picked = _generate(ckpt, prompts, max_tokens=1)
    assert any(plan is not None for plan in derived)
    monkeypatch.setattr(AttentionPlan, "picked", lambda self, rows: None)
    assert picked == _generate(ckpt, prompts, max_tokens=1)  # tokens and logprobs, bit for bit


def test_picked_rows_out_of_order_or_outside_the_step_are_not_packed():
    decode = type("Rows", (), {"num_tokens": 2, "rows": torch.arange(2), "table": torch.zeros(2, 1, dtype=torch.long),
                               "pointers": (0, 0, 0, 0), "page_size": 4, "window": None, "chunk_after": 0})()
    cos = torch.zeros(5, 1, 4)
    slots = torch.arange(5)
    assert fused_layer.step_metadata(decode, cos, cos, slots, torch.tensor([1, 4])) is not None
    for bad in ([4, 1], [2, 2], [-1, 3], [3, 5]):
        assert fused_layer.step_metadata(decode, cos, cos, slots, torch.tensor(bad)) is None, bad


def test_a_slot_outside_the_pool_raises_before_writing(ckpt, monkeypatch):
    monkeypatch.setattr(build, "_enabled", build.enabled())
    calls = []
    real = fused_layer.decode_layer

    def bad_slots(consts, step, x, k_cache, v_cache, decode):
        step = type(step)(*step)
        slots = torch.full((step[0],), k_cache.shape[0], dtype=torch.int64)  # the front's rows (S_T)
        step[fused_layer._STEP.index("slots")] = slots.data_ptr()
        before = k_cache.clone()
        with pytest.raises(ValueError, match="outside the pool"):
            real(consts, step, x, k_cache, v_cache, decode)
        assert torch.equal(before, k_cache)
        calls.append(1)
        return None  # the part-by-part path serves the step

    monkeypatch.setattr(fused_layer, "decode_layer", bad_slots)
    _generate(ckpt, _prompts(2))
    assert calls
