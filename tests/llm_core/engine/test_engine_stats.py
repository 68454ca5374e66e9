"""EngineStats: built by the thread that steps, read by any other without touching engine state,
immutable once published, exact when the engine goes idle."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.engine import llm_engine
from llm_core.engine.stats import EngineStats, TokenCounters
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def make(model) -> LLMEngine:
    return LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=512, num_swa_tokens=256,
                                         enable_prefix_caching=True))


def spy_threads(monkeypatch, engine: LLMEngine) -> dict[str, list[str]]:
    """Names of the threads that build snapshots and read the prefix cache."""
    seen: dict[str, list[str]] = {"collect": [], "prefix": []}
    collect, prefix_stats = EngineStats.collect.__func__, engine.prefix_cache.stats

    def spy_collect(cls, *a, **kw):
        seen["collect"].append(threading.current_thread().name)
        return collect(cls, *a, **kw)

    def spy_prefix():
        seen["prefix"].append(threading.current_thread().name)
        return prefix_stats()

    monkeypatch.setattr(EngineStats, "collect", classmethod(spy_collect))
    monkeypatch.setattr(engine.prefix_cache, "stats", spy_prefix)
    return seen


def test_snapshot_is_built_by_the_stepping_thread_and_immutable(model, monkeypatch):
    engine = make(model)
    seen = spy_threads(monkeypatch, engine)
    prompt = list(range(3, 40))
    read: list[EngineStats] = []

    def engine_thread() -> None:
        for i in range(3):
            engine.add_request(f"r{i}", prompt, PARAMS)  # same prompt: later ones hit the prefix cache
            while engine.has_unfinished():
                engine.step()

    t = threading.Thread(target=engine_thread, name="the-engine")
    t.start()
    while t.is_alive():  # a reader that never waits for the engine
        read.append(engine.stats())
        time.sleep(0.0005)
    t.join()
    read.append(engine.stats())
    assert seen["collect"] and set(seen["collect"]) == {"the-engine"}
    assert set(seen["prefix"]) == {"the-engine"}  # stats() never walked the tree for a reader

    s = read[-1]
    assert s is engine.stats()  # published once; readers get that same object until the next step
    assert s.running == s.queue_depth == 0 and s.kv_pool["full"].used_pages > 0  # the tree keeps pages
    assert sum(s.prefix_cache_hit_tokens.values()) == s.prefix_cache_hit_tokens["l1"] > 0
    assert s.prefix_cache_query_tokens == 3 * len(prompt) and s.prefix_cache["tree_nodes"] >= 1
    assert [r.kv_pool["full"].peak_pages for r in read] == sorted(r.kv_pool["full"].peak_pages for r in read)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.running = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kv_pool["full"].used_pages = 0
    with pytest.raises(TypeError):
        s.kv_pool["full"] = None
    with pytest.raises(TypeError):
        s.prefix_cache_hit_tokens["l1"] = 0
    assert s.to_dict()["kv_pool"]["full"]["free_pages"] == s.kv_pool["full"].free_pages


def test_busy_steps_read_the_tree_at_most_every_interval(model, monkeypatch):
    engine = make(model)
    seen = spy_threads(monkeypatch, engine)
    monkeypatch.setattr(llm_engine, "PREFIX_STATS_INTERVAL_S", 3600.0)
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 2 and len(seen["collect"]) == steps
    assert len(seen["prefix"]) == 1  # the step that left the engine idle; busy ones reused the last read
    assert engine.stats().prefix_cache_query_tokens == 17


class _NotReady:
    """Media rows that have not arrived: the request cannot run yet."""

    def ready_until(self) -> int:
        return 0

    def rows(self, start, end):
        raise AssertionError("no row is ready")


def test_a_request_waiting_for_its_media_is_one_prefix_query_not_one_per_step(model):
    """A waiting request is matched and given back every step until it can run; each of those
    lookups used to count as a query and its hit tokens as hits (a waiting video inflated the
    hit-rate metrics step after step)."""
    engine = make(model)
    prompt = list(range(5, 29))
    engine.add_request("warm", prompt, PARAMS)
    while engine.has_unfinished():
        engine.step()
    before = engine.publish_stats()
    engine.add_request("m", prompt + [7] * 4, PARAMS, embeds=_NotReady(), extra_keys=((24, 28, b"img"),))
    for _ in range(10):
        engine.step()
    waiting = engine.publish_stats()
    assert waiting.prefix_cache["queries"] == before.prefix_cache["queries"] == 1
    assert waiting.prefix_cache_query_tokens == before.prefix_cache_query_tokens
    assert waiting.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
    engine.abort("m")
    engine.step()
    assert not engine.has_unfinished()


@pytest.mark.parametrize("caching", [False, True])
def test_token_counters_count_computed_prompt_and_generated_tokens(model, caching):
    """prompt_tokens: what prefill computed (a prefix-cache hit is not computed); generation_tokens:
    every token handed out. Exact when idle, whatever the chunking (a small step budget)."""
    engine = LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=512, num_swa_tokens=256,
                                           enable_prefix_caching=caching, max_num_batched_tokens=16))
    prompts = [list(range(3, 40)), list(range(3, 40)), list(range(50, 61))]
    outputs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():  # one after another: the second finds the first's prefix
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.publish_stats()
    hits = sum(stats.prefix_cache_hit_tokens.values())
    assert (hits > 0) == caching
    assert stats.prompt_tokens == sum(map(len, prompts)) - hits
    assert stats.generation_tokens == sum(map(len, outputs.values())) == 3 + 4 + 5


@pytest.mark.parametrize("caching", [False, True])
def test_preemptions_count_each_prompt_and_prefix_lookup_once(model, caching):
    """A preempted request is recomputed; its prompt tokens and its prefix-cache lookup still count
    once (its first admission), as vLLM counts them: the recompute is recomputed_tokens, its new
    lookup preempted_* (it used to add its prompt to prompt_tokens again, and its whole sequence to
    the queries and its own pages to the hits)."""
    engine = LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=200, num_swa_tokens=200,
                                           enable_prefix_caching=caching, max_num_batched_tokens=16,
                                           max_chunk_tokens=5))
    shared = list(range(3, 23))
    prompts = [shared + [100 + i] * 3 for i in range(5)] + [list(range(200 + 9 * i, 209 + 9 * i)) for i in range(3)]
    outs = {}
    for i, p in enumerate(prompts):  # all at once: they outgrow the pools and preempt each other
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    s = engine.publish_stats()
    assert s.preemptions > 0 and all(o.finish_reason == "length" for o in outs.values())
    hits = sum(s.prefix_cache_hit_tokens.values())
    # the hits are the first admissions' (what each usage reports as cached)
    assert hits == sum(o.num_cached_tokens for o in outs.values())
    assert s.prompt_tokens == sum(map(len, prompts)) - hits
    assert s.recomputed_tokens > 0
    if caching:
        assert hits > 0  # the shared prefix, once the first request computed it
        assert s.prefix_cache["queries"] == len(prompts)
        assert s.prefix_cache_query_tokens == sum(map(len, prompts))
        assert s.prefix_cache["preempted_queries"] == s.preemptions  # every victim came back once
    else:
        assert s.prefix_cache_query_tokens == 0 and hits == 0


def test_a_readmission_hit_past_the_mark_is_prompt_work_the_first_hit_did_not_cover():
    """prompt_tokens + the first admission's hit = the prompt, however a preemption falls: a request
    preempted after 512 of its 4,000 prompt tokens whose re-admission finds 3,968 of them cached
    (another request computed them meanwhile) still counts 4,000 - 0, none of it recomputed."""
    class Req:  # the fields TokenCounters reads (weak-referenceable, as a Request is)
        num_prompt_tokens, num_cached_tokens, num_computed_tokens = 4000, 0, 0
        num_preemptions, num_computed_high = 0, 0

    counters, req = TokenCounters(), Req()
    counters.admitted(req)
    counters.computed(req, 0, 512)
    req.num_preemptions, req.num_computed_tokens, req.num_cached_tokens = 1, 3968, 3968
    counters.admitted(req)
    counters.computed(req, 3968, 4000)
    assert (counters.num_prompt_tokens, counters.num_recomputed_tokens) == (4000, 0)
    assert counters.cached_prompt_tokens(req) == 0  # usage: the first admission's hit
