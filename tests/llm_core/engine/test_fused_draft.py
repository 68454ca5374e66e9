"""The fused draft (llm_core/engine/speculative/fused_draft.py) against the path it replaces
(DraftSteps + the MTPLayer module): same drafted tokens on random weights (window 8, q/k head 24 != v
head 16, sinks), from the first positions (fewer keys than the window) to far past the window, one
request or several with different windows and k; with and without the token table; refolded after a
weight changes in place; outputs still equal plain decoding."""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.speculative import fused_draft
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
from tests.support.draft_compare import compare_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("fused") / "hf", mtp_layers=1))


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(page_size=4, max_chunk_tokens=16, num_full_tokens=1024, num_swa_tokens=512,
                                         speculative_tokens=3, speculative_adaptive=False, **kw))


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fused_draft_tokens_equal_the_module_path(model):
    eng = engine(model)
    assert eng.speculative.proposer.fused is not None
    positions = []
    real = eng.speculative.proposer.fused.draft
    eng.speculative.proposer.fused.draft = lambda *a: positions.extend(a[1]) or real(*a)
    seen = compare_drafts(eng, "_draft_fused", "_draft_first")
    prompts = [prompt(1, 2), prompt(2, 19)]
    ref = LLM.from_engine(LLMEngine(model, EngineConfig(page_size=4, speculative_tokens=0))).generate(prompts, GREEDY)
    for p, r in zip(prompts, ref):
        assert LLM.from_engine(eng).generate([p], GREEDY)[0].token_ids == r.token_ids
    assert min(positions) < 7 and max(positions) > 40  # windows shorter than 8 keys and far past it
    assert len({tuple(t) for _, _, t in seen}) > 5  # the drafts are not one repeated guess


def test_batched_requests_of_different_windows_and_lengths(model):
    """Requests drafting together: windows of different fill (masked on the left), different k
    (max_tokens caps k near the end), and outputs equal to plain decoding."""
    eng = engine(model)
    seen = compare_drafts(eng, "_draft_fused", "_draft_first")
    prompts = [prompt(6, 2), prompt(7, 5), prompt(8, 23)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 17, 24)]
    ref = LLM.from_engine(LLMEngine(model, EngineConfig(page_size=4, speculative_tokens=0))).generate(prompts, params)
    outs = LLM.from_engine(eng).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert max(b for b, _, _ in seen) == 3
    assert any(len(set(ks)) > 1 for _, ks, _ in seen)


def test_without_the_token_table(model, monkeypatch):
    monkeypatch.setattr(fused_draft, "TOKEN_TABLE_MAX_BYTES", 0)
    eng = engine(model)
    seen = compare_drafts(eng, "_draft_fused", "_draft_first")
    LLM.from_engine(eng).generate([prompt(3, 11)], GREEDY)
    assert eng.speculative.proposer.fused.table is None and len(seen) > 5


def test_refolds_after_a_weight_changes_in_place(model):
    eng = engine(model)
    seen = compare_drafts(eng, "_draft_fused", "_draft_first")
    LLM.from_engine(eng).generate([prompt(4, 9)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    before = len(seen)
    layer = eng.speculative.proposer.fused.layer
    saved = layer.mlp.down_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(3.0)
        LLM.from_engine(eng).generate([prompt(5, 9)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        with torch.no_grad():
            layer.mlp.down_proj.weight.copy_(saved)
    assert len(seen) > before


def test_rope_matrix_equals_partial_rotary(model):
    """x @ R_p is the layer's rotate-half RoPE at position p (partial: identity past rotary_dim), also
    for positions past the table's first size (it grows)."""
    fused = engine(model).speculative.proposer.fused
    fused.refresh()
    rot = fused.layer.self_attn.rotary
    assert 0 < rot.rotary_dim < fused.d
    for start in (0, 5, 300):
        r = fused._rotations([start, start + 7], 3)  # [3 steps, 2 requests, D, D]
        x = torch.randn(3, 2, 5, fused.d)
        want = x.clone()
        for b, first in enumerate((start, start + 7)):
            rot.apply_(want[:, b], *rot.tables(torch.arange(first, first + 3), torch.float32))
        torch.testing.assert_close(torch.matmul(x, r), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused._rotations([start], 3), r[:, :1])  # one request: table slices
