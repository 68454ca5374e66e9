"""A prompt's own checkpoints (media and message ends) are capped per request: a prompt with 1000 of
them keeps the windows of the first and the last few only, the tree's SWA stays bounded, tokens
stay those of the cache-off engine and a branch at a kept checkpoint still hits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.request import cap_checkpoints

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@given(st.lists(st.integers(1, 500), max_size=60), st.integers(0, 20))
def test_cap_keeps_the_first_and_the_last(checkpoints, limit):
    got = cap_checkpoints(checkpoints, limit)
    ordered = sorted(set(checkpoints))
    assert list(got) == sorted(got) and set(got) <= set(ordered) and len(got) == min(limit, len(ordered))
    if got:
        assert got[0] == ordered[0]
        assert list(got[1:]) == (ordered[len(ordered) - len(got) + 1:] if len(got) > 1 else [])


def test_cap_rejects_a_negative_limit():
    with pytest.raises(ValueError, match="limit"):
        cap_checkpoints((1, 2), -1)
    with pytest.raises(ValueError, match="prefix_checkpoints_per_request"):
        EngineConfig(prefix_checkpoints_per_request=-1)


def engine(model, **kw) -> LLMEngine:
    cfg = dict(page_size=PAGE, max_num_batched_tokens=256, num_full_tokens=4096, num_swa_tokens=4096,
               prefix_checkpoint_every=0)
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def run(eng: LLMEngine, rid: str, prompt: list[int], checkpoints=()):
    eng.add_request(rid, prompt, GREEDY, checkpoints=checkpoints)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


def test_a_thousand_media_ends_keep_a_bounded_number_of_windows(model):
    prompt = torch.randint(3, 512, (1010,), generator=torch.Generator().manual_seed(0)).tolist()
    marks = tuple(range(5, 1005))  # 1000 checkpoints, one per position
    kept = {}
    for limit in (8, 10_000):
        eng = engine(model, enable_prefix_caching=True, prefix_checkpoints_per_request=limit)
        first = run(eng, "a", prompt, marks)
        kept[limit] = eng.prefix_cache.stats()["tree_swa_pages"]
        eng.prefix_cache.check_integrity()
        # a branch right after the last kept checkpoint (1004) resumes at its page; one after a
        # dropped middle one (500) only where the first checkpoint's window is (page of 5)
        late = run(eng, "late", prompt[:1004] + [7, 8, 9])
        mid = run(eng, "mid", prompt[:500] + [7, 8, 9])
        assert late.num_cached_tokens == 1004 // PAGE * PAGE
        if limit == 8:
            assert mid.num_cached_tokens == 5 // PAGE * PAGE
            off = engine(model)
            assert [first.token_ids, late.token_ids, mid.token_ids] == [
                run(off, r, p).token_ids for r, p in (("a", prompt), ("late", prompt[:1004] + [7, 8, 9]),
                                                      ("mid", prompt[:500] + [7, 8, 9]))]
    # window 8 at page 4: a kept window is at most 3 pages; 8 checkpoints + the prompt's end + the tail
    assert kept[8] <= 3 * (8 + 2) < kept[10_000]
