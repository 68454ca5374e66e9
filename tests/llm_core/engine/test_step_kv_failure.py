"""A step whose KV cannot be had (a prefix reload from L2/L3 that already failed) ends its batch with
that error -- not an ``UnboundLocalError`` from the isolation retry -- and the engine goes on."""

from __future__ import annotations

import pytest
import torch

from llm_core import SamplingParams
from llm_core.engine.model_runner import run_isolated
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

from tests.llm_core.engine.test_llm_generate import engine, ids

pytestmark = pytest.mark.usefixtures("one_thread")

LOAD_ERROR = "loading cached KV failed: simulated device error"


class NeverRuns:
    """A stepper the step must not reach: there is no KV to run it on."""

    def run(self, entries, kv):
        raise AssertionError("stepped without KV")

    forward = run


def failing_kv_buffers():
    raise RuntimeError(LOAD_ERROR)


def test_kv_buffers_failure_is_each_entrys_error():
    entries = ["a", "b", "c"]  # run_isolated treats entries as opaque
    result = run_isolated(NeverRuns(), entries, failing_kv_buffers)
    assert result.sampled == []
    assert [e for e, _ in result.failed] == entries
    for _, exc in result.failed:
        assert isinstance(exc, RuntimeError) and str(exc) == LOAD_ERROR


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def _finish(eng) -> dict:
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_engine_reports_the_load_error_and_serves_later_requests(model, monkeypatch):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference = engine(model).engine
    reference.add_request("late", ids(7, 9), params)
    alone = _finish(reference)["late"]

    eng = engine(model).engine
    real, failures = eng.prefix_cache.kv_buffers, [failing_kv_buffers]

    def kv_buffers(pool):  # the first step's KV cannot be had; later steps' can
        return failures.pop()() if failures else real(pool)

    monkeypatch.setattr(eng.prefix_cache, "kv_buffers", kv_buffers)
    eng.add_request("x", ids(1, 6), params)
    eng.add_request("y", ids(2, 6), params)
    failed = _finish(eng)
    for rid in ("x", "y"):
        assert failed[rid].finish_reason == "error"
        assert failed[rid].error == f"RuntimeError: {LOAD_ERROR}"  # the real cause, not UnboundLocalError
    eng.add_request("late", ids(7, 9), params)
    late = _finish(eng)["late"]
    assert late.finish_reason == "length" and late.token_ids == alone.token_ids
    eng.prefix_cache.clear()
    assert eng.pool.all_free()
