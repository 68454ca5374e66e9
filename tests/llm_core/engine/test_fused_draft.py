"""The batch-1 fused draft (llm_core/engine/speculative/fused_draft.py) against the MTPLayer module
path it replaces: same drafted tokens on random weights (window 8, q/k head 24 != v head 16, sinks),
from the first positions (fewer keys than the window) to far past the window; with and without the
token table; refolded after a weight changes in place; outputs still equal plain decoding."""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.speculative import fused_draft
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

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


def compare_with_module_path(eng: LLMEngine) -> list[tuple[int, list[int]]]:
    """Every batch-1 draft also runs through the module path (_draft_first); the tokens must agree.
    Returns (position, drafted tokens) of each draft compared."""
    proposer = eng.speculative.proposer
    real, seen = proposer.draft, []

    def draft(entries, kv):
        lengths = [len(e.request.token_ids) for e in entries]
        real(entries, kv)
        if len(entries) == 1:
            e, n = entries[0], lengths[0]
            fused = e.request.token_ids[n:]
            del e.request.token_ids[n:]
            proposer._draft_first(entries, kv)
            assert e.request.token_ids[n:] == fused, f"position {e.start}"
            seen.append((e.start, fused))

    proposer.draft = draft
    return seen


def test_fused_draft_tokens_equal_the_module_path(model):
    eng = engine(model)
    assert eng.speculative.proposer.fused is not None
    seen = compare_with_module_path(eng)
    prompts = [prompt(1, 2), prompt(2, 19)]
    ref = LLM.from_engine(LLMEngine(model, EngineConfig(page_size=4, speculative_tokens=0))).generate(prompts, GREEDY)
    for p, r in zip(prompts, ref):
        assert LLM.from_engine(eng).generate([p], GREEDY)[0].token_ids == r.token_ids
    positions = [p for p, _ in seen]
    assert min(positions) < 7 and max(positions) > 40  # windows shorter than 8 keys and far past it
    assert len({tuple(t) for _, t in seen}) > 5  # the drafts are not one repeated guess


def test_without_the_token_table(model, monkeypatch):
    monkeypatch.setattr(fused_draft, "TOKEN_TABLE_MAX_BYTES", 0)
    eng = engine(model)
    seen = compare_with_module_path(eng)
    LLM.from_engine(eng).generate([prompt(3, 11)], GREEDY)
    assert eng.speculative.proposer.fused.table is None and len(seen) > 5


def test_refolds_after_a_weight_changes_in_place(model):
    eng = engine(model)
    seen = compare_with_module_path(eng)
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
        r = fused._rotations(start, 3)
        x = torch.randn(3, 5, fused.d)
        want = x.clone()
        rot.apply_(want, *rot.tables(torch.arange(start, start + 3), torch.float32))
        torch.testing.assert_close(torch.bmm(x, r), want, rtol=1e-5, atol=1e-6)
