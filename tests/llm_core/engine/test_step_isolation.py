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


class _PickyTokenizer:
    """A tokenizer that cannot decode some ids the model can sample (a vocabulary padded past it)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def decode(self, token_ids, skip_special_tokens=True):
        if self.bad & set(token_ids):
            raise KeyError("id not in the tokenizer's vocabulary")
        return "".join(chr(97 + t % 26) for t in token_ids)


def test_a_token_the_tokenizer_cannot_decode_fails_its_request_alone(model):
    """The final text is decoded after the scheduler already advanced every entry of the step:
    the exception used to leave the loop, so the requests after it never got their token and sat
    RUNNING with nothing left to compute -- no error, no progress, for good."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = _run(engine(model), [("x", ids(1, 8), params, None)])["x"].token_ids[0]
    llm = engine(model, tokenizer=_PickyTokenizer({first}))
    outs = _run(llm, [("x", ids(1, 8), params, None),
                      ("y", ids(1234, 8), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), None)])
    assert outs["x"].finish_reason == "error" and outs["x"].error_kind is ErrorKind.INTERNAL
    assert "KeyError" in outs["x"].error
    assert outs["y"].finish_reason == "length" and len(outs["y"].token_ids) == 6


def test_a_tier_load_that_failed_before_the_step_ends_its_batch_not_on_stale_kv(model, monkeypatch):
    """A prefix reloaded from the host tier whose copy already failed when the step asked for its
    buffers: the step raised before its isolation, the request stayed RUNNING on pages whose KV
    never landed and the next step decoded garbage. Now the batch ends with the error."""
    import llm_core.kvcache.tiers.tier_threads as tier_threads

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefix = ids(5, 40)
    llm = engine(model, kv_host_bytes=2_000_000, kv_model_id="m")
    eng = llm.engine
    eng.add_request("a", prefix, params)
    while eng.has_unfinished():
        eng.step()
    eng.prefix_cache.evict(10**6, 10**6)  # L1 -> the host tier
    assert eng.pool.full.num_used == 0
    submit = tier_threads.KVTierThreads.submit

    def failing_fast(self, copies):  # the copy fails, and before the engine asks for the buffers
        job = submit(self, copies)
        job.events[-1].wait(5)
        return job
    monkeypatch.setattr(tier_threads, "scatter_layer", lambda *a: (_ for _ in ()).throw(RuntimeError("copy failed")))
    monkeypatch.setattr(tier_threads.KVTierThreads, "submit", failing_fast)
    eng.add_request("q", prefix + ids(6, 3), params)
    outs = {o.request_id: o for o in eng.step() if o.finished}
    assert outs["q"].finish_reason == "error" and "copy failed" in outs["q"].error
    assert not eng.has_unfinished()


def test_a_tiny_temperature_is_greedy():
    """Dividing fp32 logits by 1e-40 overflows: the NaN softmax always picked token 0."""
    from llm_core.engine.sampling import Sampler

    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    for t in (1e-6, 1e-30, 1e-40):
        params = SamplingParams(temperature=t)
        assert params.greedy
        assert Sampler()(logits, [params], [None]).token_ids == [int(logits.argmax())]
