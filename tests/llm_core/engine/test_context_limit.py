"""A request's context is capped at what the Full pool holds for it alone (vLLM refuses to start
with a pool below max_model_len; this engine caps the context instead): a longer prompt is refused
at admission, and generation that reaches the cap ends with "length" -- not with an "error"
part-way, and not counted as a preemption."""

from __future__ import annotations

import pytest

from llm_core import ErrorKind, SamplingParams
from tests.llm_core.engine.test_llm_generate import PAGE, ckpt, drained, engine, ids, model  # noqa: F401
from tests.llm_core.engine.test_scheduler import drive, make, req

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_lone_request_stops_with_length_at_the_full_pool(model):
    llm = engine(model, num_full_tokens=32, num_swa_tokens=32, enable_prefix_caching=False)
    eng = llm.engine
    assert eng.max_context_tokens == 32 < eng.max_model_len
    out = llm.generate([ids(3, 20)], GREEDY)[0]
    assert out.finish_reason == "length" and out.error is None
    assert len(out.prompt_token_ids) + len(out.token_ids) == 32  # the whole pool, as at max_model_len
    roomy = engine(model).generate([ids(3, 20)], GREEDY)[0]
    assert out.token_ids == roomy.token_ids[:12]
    assert eng.stats().preemptions == 0 and eng.stats().max_context_tokens == 32
    assert drained(eng)


def test_prompt_longer_than_the_full_pool_is_refused_at_admission(model):
    llm = engine(model, num_full_tokens=32, num_swa_tokens=32)
    out, ok = llm.generate([ids(4, 32), ids(5, 31)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "error" and out.error_kind is ErrorKind.CONTEXT_LENGTH and not out.token_ids
    assert "context limit of 32 tokens" in out.error and "KV pool" in out.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 1  # 31 + 1 fills the pool
    assert llm.engine.stats().preemptions == 0


def test_scheduler_fails_a_lone_unfittable_request_without_counting_a_preemption():
    """Without the engine's cap (the scheduler alone, or an SWA pool too small for one request) a
    running request that outgrows the pools alone fails; nothing was preempted."""
    s = make(full=16, swa=32, page=PAGE, budget=64)
    r = req(12, max_tokens=10)
    batches = drive(s, [r])
    assert r.finish_reason == "error" and r.error_kind is ErrorKind.CONTEXT_LENGTH
    assert r.num_output_tokens == 5 and any(r in b.failed for b in batches)
    assert s.num_preemptions == 0 and r.num_preemptions == 0
    assert not any(b.preempted for b in batches) and s.pool.all_free()
