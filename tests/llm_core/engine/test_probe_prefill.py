"""LLMEngine.probe_prefill: a scratch prefill step to time (mm_pipeline/runtime/cpu_threads/thread_choice.py)
that leaves no trace -- the pools end as they were (peaks included), no request, counter or prefix
-cache entry appears, and the tokens of requests before and after it are those of an engine that
never probed."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from llm_core import SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

from tests.llm_core.engine.test_llm_generate import engine, ids

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", mtp_layers=2),
                      dtype=torch.float32)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("kind", ["plain", "mtp"])
def test_probe_leaves_pools_counters_and_tokens_as_they_were(request, kind, prefix_caching):
    """Under MTP too (the speculative runner's forward: the target and the MTP layers' KV), with the
    speculative counters, the draft-length state and the proposer's kept tails as they were."""
    model = request.getfixturevalue("model" if kind == "plain" else "mtp_model")
    prompts = [ids(1, 27), ids(2, 41)]
    plain = engine(model, enable_prefix_caching=prefix_caching)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    probed = engine(model, enable_prefix_caching=prefix_caching)
    eng = probed.engine
    assert (eng.speculative is not None) == (kind == "mtp")
    assert eng.probe_prefill(40)  # before any request
    assert eng.pool.full.peak_used == 0 and eng.pool.swa.peak_used == 0  # a probe is no use of the pools
    first = [o.token_ids for o in probed.generate(prompts[:1], GREEDY)]
    before = eng.publish_stats(complete=True)
    spec = eng.speculative
    spec_before = None if spec is None else (dataclasses.astuple(spec.stats), spec.draft_length.steps,
                                              len(spec.proposer._tails))
    assert eng.probe_prefill(40) and eng.probe_prefill(3)  # between requests, several pages and one
    gc.collect()  # the scratch request's tail is kept weakly: gone with the request
    after = eng.publish_stats(complete=True)
    if spec is not None:
        assert (dataclasses.astuple(spec.stats), spec.draft_length.steps, len(spec.proposer._tails)) == spec_before
    assert after.kv_pool == before.kv_pool  # used and peak pages per pool
    assert dataclasses.replace(after, taken_at=0) == dataclasses.replace(before, taken_at=0)  # counters too
    assert first + [o.token_ids for o in probed.generate(prompts[1:], GREEDY)] == want


def test_probe_refuses_what_it_cannot_run(model):
    eng = engine(model).engine
    with pytest.raises(ValueError, match="num_tokens"):
        eng.probe_prefill(0)
    small = engine(model, num_full_tokens=32, num_swa_tokens=32).engine
    assert small.probe_prefill(1 << 20) is False  # more pages than the pools hold: nothing runs
    assert small.pool.full.num_used == 0 and small.pool.swa.num_used == 0
