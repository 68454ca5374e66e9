"""Speculative decoding (MTP) with logits processing stays exact: requests with logit_bias,
min_tokens or a penalty never draft (SpeculativeRunner.num_draft_tokens), so their tokens equal plain
decoding's; min_p is part of the verified distribution and drafts as usual."""

from __future__ import annotations

import pytest

from llm_core import SamplingParams
from tests.llm_core.engine.test_speculative import assert_same, engine, generate, ids, model  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROCESSED = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.6, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(max_tokens=20, temperature=0.0, min_tokens=8, logit_bias={2: 100, 40: -100}),
    SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True, repetition_penalty=1.3, min_p=0.1),
]
PLAIN = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("mode", ["first", "chain"])
def test_processed_requests_equal_plain_decoding_next_to_drafting_ones(model, mode):
    prompts = [ids(200 + i, n) for i, n in enumerate((4, 13, 21, 8, 30))]
    params = [*PROCESSED, PLAIN]
    ref = generate(engine(model, speculative_tokens=0), prompts, params)
    eng = engine(model, speculative_tokens=3, speculative_layers=mode, speculative_adaptive=False)
    drafted: list[int] = []
    real = eng.speculative.num_draft_tokens

    def count(request, running, max_len):
        k = real(request, running, max_len)
        if request.params.processes_logits:
            drafted.append(k)
        return k

    eng.speculative.num_draft_tokens = count
    out = generate(eng, prompts, params)
    assert_same(ref, out)
    assert eng.stats().spec_draft_tokens > 0  # the plain request drafted
    assert drafted and not any(drafted)  # the processed ones never did


def test_min_p_drafts_and_stays_exact(model):
    prompts = [ids(210 + i, n) for i, n in enumerate((6, 19))]
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=21 + i, ignore_eos=True, min_p=0.15)
              for i in range(2)]
    ref = generate(engine(model, speculative_tokens=0), prompts, params)
    eng = engine(model, speculative_tokens=3, speculative_adaptive=False)
    assert_same(ref, generate(eng, prompts, params))
    assert eng.stats().spec_draft_tokens > 0
