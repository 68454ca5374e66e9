"""``RequestOutput.num_cached_tokens`` (usage.prompt_tokens_details.cached_tokens) is what vLLM
reports: the prompt tokens the prefix cache supplied at the request's first admission. A
re-admission after a preemption matches the request's own generated tokens too; that hit must not
show up as more cached tokens than the prompt has."""

from __future__ import annotations

import pytest

from llm_core import SamplingParams
from tests.llm_core.engine.test_llm_generate import PAGE, ckpt, drained, engine, ids, model  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)


def test_cached_tokens_never_exceed_the_prompt_after_preemptions(model):
    llm = engine(model, num_full_tokens=200, num_swa_tokens=200)
    prompts = [ids(500 + i, 8) for i in range(5)]
    outs = llm.generate(prompts, LONG)
    assert llm.engine.stats().preemptions > 0
    assert all(o.finish_reason == "length" for o in outs)
    # nothing was cached before these prompts came: whatever a re-admission matched was computed
    # by this very request (before: 24 "cached" tokens reported for an 8-token prompt)
    assert [o.num_cached_tokens for o in outs] == [0] * len(outs)
    assert drained(llm.engine)


def test_cached_tokens_are_the_first_admissions_hit(model):
    llm = engine(model, num_full_tokens=200, num_swa_tokens=200)
    warm = ids(600, 10)
    llm.generate([warm], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    outs = llm.generate([warm] + [ids(610 + i, 8) for i in range(4)], LONG)
    assert llm.engine.stats().preemptions > 0
    assert outs[0].num_cached_tokens == (len(warm) - 1) // PAGE * PAGE
    assert all(o.num_cached_tokens <= len(o.prompt_token_ids) for o in outs)
