"""A stream whose reader falls behind the engine gets the steps since its last read as one output
(``OmniEngine.generate`` merges the queued outputs)."""

from __future__ import annotations

import asyncio

import pytest

from llm_core import SamplingParams
from tests.mm_pipeline.runtime.test_omni_engine import assert_idle, collect, make

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def test_a_consumer_that_falls_behind_gets_the_steps_since_as_one_delta(ckpt):
    """A consumer that reads slower than the engine steps (a slow client, a Ray stream at GPU decode
    rates) gets what was generated since its last read as one delta -- the same tokens, text and
    logprobs as a prompt reader's -- not one delta per token that it must then catch up on."""
    engine = make(ckpt)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    messages = [{"role": "user", "content": "Describe a red square."}]

    async def slow():
        deltas = []
        async for d in engine.generate(messages, params):
            deltas.append(d)
            if len(deltas) == 1:
                await asyncio.sleep(2.0)  # the engine decodes the rest meanwhile
        return deltas

    try:
        tokens, prompt = asyncio.run(collect(engine, messages, params))
        lagged = asyncio.run(slow())
        assert_idle(engine)
    finally:
        engine.shutdown()
    assert [t for d in lagged for t in d.new_token_ids] == tokens and len(tokens) == 12
    assert "".join(d.new_text for d in lagged) == "".join(d.new_text for d in prompt)
    assert [x for d in lagged for x in d.logprobs] == pytest.approx([x for d in prompt for x in d.logprobs])
    lagged_tops = [t for d in lagged for t in d.top_logprobs]
    prompt_tops = [t for d in prompt for t in d.top_logprobs]
    assert [sorted(t) for t in lagged_tops] == [sorted(t) for t in prompt_tops]  # the second run hits the
    assert [v for t in lagged_tops for v in sorted(t.values())] == pytest.approx(  # prefix cache: float
        [v for t in prompt_tops for v in sorted(t.values())])  # noise only
    assert len(lagged) < len(prompt) and max(len(d.new_token_ids) for d in lagged) > 1
    assert lagged[-1].finished and lagged[-1].completion_tokens == 12
