"""One bad request never fails another (issue 22, row 3).

A request poisoned past validation -- in its sampling (a logprobs count the vocabulary cannot give)
or in its input preparation (an embedding source that raises) -- shares a step with three good
ones. It alone ends with an internal error; the three give exactly the tokens they give in a batch
without it (seeded sampling included: the sampler's retry restores their generators), and the pools
end empty.
"""

from __future__ import annotations

import pytest
import torch

from llm_core import ErrorKind, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

from tests.llm_core.engine.test_llm_generate import engine, ids

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


class BrokenEmbeds:
    """An embedding source whose rows cannot be read (a media stream gone bad)."""

    def ready_until(self) -> int:
        return 1 << 30

    def rows(self, start, end):
        raise ValueError("corrupt media rows")


def _good_params(seeded: bool) -> list[SamplingParams]:
    if seeded:
        return [SamplingParams(max_tokens=6, temperature=0.8, top_k=40, seed=7 + i, ignore_eos=True) for i in range(3)]
    return [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3


def _run(llm, requests) -> dict:
    """requests: (id, prompt, params, embeds); every request is queued before the first step, so
    they share their steps."""
    eng = llm.engine
    for rid, prompt, params, embeds in requests:
        eng.add_request(rid, prompt, params, embeds=embeds)
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    eng.prefix_cache.clear()  # on by default: what it keeps must be all the pools hold
    assert eng.pool.all_free() and not eng.has_unfinished()
    return final


@pytest.mark.parametrize("poison", ["sampling", "input"])
def test_a_poisoned_request_fails_alone_and_the_others_are_unchanged(model, poison):
    seeded = poison == "sampling"
    good = [(f"g{i}", ids(90 + i, 5 + 3 * i), p, None) for i, p in enumerate(_good_params(seeded))]
    if poison == "sampling":
        bad_params = SamplingParams(max_tokens=6, ignore_eos=True)
        object.__setattr__(bad_params, "logprobs", 10**6)  # past validation: topk over the vocabulary raises
        bad = ("bad", ids(99, 7), bad_params, None)
    else:
        bad = ("bad", ids(99, 7), SamplingParams(max_tokens=6, ignore_eos=True), BrokenEmbeds())

    alone = _run(engine(model), good)
    mixed = _run(engine(model), [good[0], good[1], bad, good[2]])

    assert mixed["bad"].finish_reason == "error" and mixed["bad"].error_kind is ErrorKind.INTERNAL
    expected = "RuntimeError" if poison == "sampling" else "ValueError: corrupt media rows"
    assert expected in mixed["bad"].error
    for rid, *_ in good:
        assert mixed[rid].finish_reason == "length" and mixed[rid].error is None
        assert mixed[rid].token_ids == alone[rid].token_ids


def test_a_step_failing_for_no_request_ends_the_batch_and_the_engine_keeps_serving(model):
    """A fault no single request reproduces (every probe passes) is the device's: the batch ends."""
    llm = engine(model)
    runner, calls = llm.engine.runner, []
    run = runner.run

    def fails_once(entries, kv):
        calls.append(len(entries))
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return run(entries, kv)

    runner.run = fails_once
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = _run(llm, [("a", ids(70, 6), params, None), ("b", ids(71, 4), params, None)])
    assert all(o.error == "RuntimeError: device fell over" for o in outs.values())
    assert _run(llm, [("c", ids(70, 6), params, None)])["c"].finish_reason == "length"
