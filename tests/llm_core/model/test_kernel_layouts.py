"""Weights re-laid for the device's GEMMs (``MiMoV2ForCausalLM.use_kernel_layouts_``, applied by the
model runner): the same values in column-major linear weights (except one tied to the embedding),
and an engine over them decodes the row-major model's tokens with the same logprobs, at batch 1 and
at batch 32 (the skinny GEMMs of a decode step are what the layout is for)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import ops
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")


def test_layouts_keep_values_and_skip_a_tied_head(ckpt, tmp_path):
    model = load_model(ckpt, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.use_kernel_layouts_()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert model.lm_head in linears
    for m in linears:
        assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()
    ptr = model.lm_head.weight.data_ptr()
    model.use_kernel_layouts_()  # idempotent: no second copy
    assert model.lm_head.weight.data_ptr() == ptr

    tied = load_model(build_tiny_hf_checkpoint(tmp_path / "tied", tie_word_embeddings=True), dtype=torch.float32)
    tied.use_kernel_layouts_()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.is_contiguous()  # embedding lookups gather whole rows


def _generate(model, prompts: list[list[int]]):
    cfg = EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=32,
                       max_num_batched_tokens=512)
    llm = LLM.from_engine(LLMEngine(model, cfg))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 32])
def test_engine_over_relaid_weights_matches_row_major(ckpt, monkeypatch, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 512, (batch, 11), generator=g).tolist()
    fast = _generate(load_model(ckpt, dtype=torch.float32), prompts)
    monkeypatch.setattr(ops, "linear_weight_layout", lambda w: w)  # the row-major reference
    ref_model = load_model(ckpt, dtype=torch.float32)
    ref = _generate(ref_model, prompts)
    assert ref_model.lm_head.weight.is_contiguous()
    for (toks, lps, tops), (rtoks, rlps, rtops) in zip(fast, ref):
        assert toks == rtoks
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(rlps), rtol=0, atol=1e-5)
        for top, rtop in zip(tops, rtops):
            assert top.keys() == rtop.keys()
