"""A decoder layer of an all-decode step in one C call (kernels/native/fused_layer.c) decodes the same
tokens with the same logprobs, bit for bit, as the layer run part by part (each part its own C call),
at batch 1 and 8 on the tiny model (dense and MoE layers, full and sliding, sinks); it served the
decode steps' layers; a routing tie still defers to the torch router; a slot outside the pool raises."""

from __future__ import annotations

import pytest
import torch

from kernels.native import build, fused_layer
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.layers.fused_decode import FusedDecode
from llm_core.model.layers.moe import SparseMoE
from llm_core.model.loader import load_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(fused_layer._lib() is None, reason="no C compiler: the torch path serves")]


def _generate(ckpt, prompts, *, tie_router: bool = False):
    cfg = EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=8,
                       max_num_batched_tokens=256)
    model = load_model(ckpt, dtype=torch.float32)
    if tie_router:  # every expert scores the same: each token's choice is ambiguous
        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.gate.weight.data.zero_()
                m.gate.e_score_correction_bias.zero_()
    llm = LLM.from_engine(LLMEngine(model, cfg))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


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


def test_a_slot_outside_the_pool_raises_before_writing(ckpt, monkeypatch):
    monkeypatch.setattr(build, "_enabled", build.enabled())
    calls = []
    real = fused_layer.decode_layer

    def bad_slots(consts, step, x, k_cache, v_cache, decode):
        step = type(step)(*step)
        slots = torch.full((decode.num_tokens,), k_cache.shape[0], dtype=torch.int64)
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
