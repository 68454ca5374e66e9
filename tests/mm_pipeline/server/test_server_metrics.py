"""``/metrics`` through prometheus_client: histogram buckets and the quantile helper, an engine
snapshot as labelled families, one registry per app, OpenMetrics on request, the event-loop
lag monitor noticing a blocked loop, token counters and per-generation families, and the periodic
engine line on the log (StatsLogger)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from llm_core.engine.stats import EngineStats, PoolUsage, frozen_map
from mm_pipeline.runtime.stats import OmniStats
from mm_pipeline.server.metrics import LoopLagMonitor, ServerMetrics, StatsLogger, histogram_buckets, histogram_quantile


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of an exposition, through prometheus' own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def a_snapshot(**llm_fields) -> OmniStats:
    llm = dict(kv_pool=frozen_map({"full": PoolUsage(16, 5, 7, 16 * 4 * 96), "swa": PoolUsage(8, 2, 3, 8 * 4 * 192)}),
               kv_page_size=4, max_context_tokens=64,
               running=3, queue_depth=1, preemptions=2, prefix_cache_hit_tokens=frozen_map({"l1": 64, "l3": 8}),
               prefix_cache_query_tokens=100, prefix_cache_evicted_pages=frozen_map({"full": 1, "swa": 4}),
               prefix_cache=frozen_map({"tree_nodes": 9, "queries": 5}), taken_at=time.monotonic())
    return OmniStats(llm=EngineStats(**{**llm, **llm_fields}), requests_in_flight=4, requests_in_flight_limit=256,
                     engine_loop_requests=4, engine_loop=frozen_map({"steps": 9, "idle_waits": 1}),
                     encoder_cache_hits=frozen_map({"memory": 7, "disk": 2}), encoder_cache_misses=3,
                     encoder_cache=frozen_map({"joins": 1}),
                     encoder=frozen_map({"encoded.image": 2, "encoded.video": 4, "pending": 0}),
                     media=frozen_map({"images_decoded": 2}), decode_pool_admitted=1, decode_pool_waiting=0,
                     taken_at=time.monotonic())


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=50))
def test_histogram_buckets_and_quantile(values):
    m = ServerMetrics()
    for v in values:
        m.e2e.observe(v)
    got = samples(m.scrape()[0].decode())
    bounds = [b for b, _ in histogram_buckets(m.e2e)]
    for b in bounds:  # cumulative counts, as exposed
        le = "+Inf" if b == float("inf") else str(b)
        assert got[("mmserve_e2e_request_latency_seconds_bucket", (("le", le),))] == sum(v <= b for v in values)
    assert got[("mmserve_e2e_request_latency_seconds_count", ())] == len(values)
    if values:
        q = histogram_quantile(m.e2e, 0.5)
        assert sum(v <= q for v in values) >= len(values) / 2  # the bucket bound holds at least half
    else:
        assert histogram_quantile(m.e2e, 0.5) == 0.0


def test_snapshot_becomes_labelled_families():
    m = ServerMetrics(a_snapshot)
    body, content_type = m.scrape()
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    text = body.decode()
    got = samples(text)
    for (name, labels), value in {
        ("mmserve_running", ()): 3, ("mmserve_queue_depth", ()): 1, ("mmserve_preemptions_total", ()): 2,
        ("mmserve_kv_pool_free_pages", (("pool", "full"),)): 11, ("mmserve_kv_pool_used_pages", (("pool", "swa"),)): 2,
        ("mmserve_kv_pool_peak_pages", (("pool", "full"),)): 7,
        ("mmserve_kv_pool_total_tokens", (("pool", "swa"),)): 32, ("mmserve_kv_pool_total_bytes", (("pool", "swa"),)): 6144,
        ("mmserve_max_context_tokens", ()): 64,
        ("mmserve_prefix_cache_hit_tokens_total", (("tier", "l3"),)): 8,
        ("mmserve_prefix_cache_evicted_pages_total", (("pool", "swa"),)): 4, ("mmserve_prefix_cache_tree_nodes", ()): 9,
        ("mmserve_encoder_cache_hits_total", (("tier", "disk"),)): 2, ("mmserve_encoder_cache_misses_total", ()): 3,
        ("mmserve_encoder_encoded_total", (("kind", "video"),)): 4, ("mmserve_media_images_decoded_total", ()): 2,
        ("mmserve_engine_loop_steps_total", ()): 9, ("mmserve_requests_in_flight", ()): 4,
    }.items():
        assert got[(name, labels)] == value, (name, labels)
    assert text.count("# TYPE mmserve_kv_pool_free_pages gauge") == 1  # one family, two labelled samples
    # an engine that only reports an LLM snapshot still gets its families; anything else, none
    assert ("mmserve_running", ()) in samples(ServerMetrics(lambda: a_snapshot().llm).scrape()[0].decode())
    assert not any(n.startswith("mmserve_running") for n, _ in samples(ServerMetrics(dict).scrape()[0].decode()))


def test_every_count_is_a_typed_counter_with_total_and_every_current_value_a_gauge():
    snap = dataclasses.replace(
        a_snapshot(prefix_cache=frozen_map({"queries": 5, "trimmed_swa_pages": 2, "tree_nodes": 9, "l2_entries": 3})),
        encoder_cache=frozen_map({"manifest_hits": 1, "manifest_misses": 2, "pending_writes": 0}),
        encoder=frozen_map({"claims": 3, "forwards.vision": 2, "encoded.video": 4, "pending": 1, "in_flight_units": 2}))
    families = {f.name: f for f in text_string_to_metric_families(ServerMetrics(lambda: snap).scrape()[0].decode())}
    assert not [n for n, f in families.items() if f.type not in ("counter", "gauge", "histogram")]
    for f in families.values():  # a counter's sample is <name>_total (its _created aside)
        assert f.type != "counter" or all(s.name in (f.name + "_total", f.name + "_created") for s in f.samples), f
    counters = {"prefix_cache_queries": 5, "prefix_cache_trimmed_swa_pages": 2, "encoder_cache_manifest_hits": 1,
                "encoder_cache_manifest_misses": 2, "encoder_claims": 3, "encoder_forwards": 2, "encoder_encoded": 4}
    for name, value in counters.items():
        assert families["mmserve_" + name].type == "counter", name
        assert sum(s.value for s in families["mmserve_" + name].samples) == value, name
    for name in ("prefix_cache_tree_nodes", "prefix_cache_l2_entries", "encoder_cache_pending_writes",
                 "encoder_pending", "encoder_in_flight_units", "running", "kv_pool_used_pages"):
        assert families["mmserve_" + name].type == "gauge", name


def test_each_app_has_its_own_registry_and_openmetrics_on_request():
    a, b = ServerMetrics(a_snapshot), ServerMetrics(a_snapshot)  # the global registry would refuse the 2nd
    a.count_request("/v1/chat/completions", 200)
    assert samples(a.scrape()[0].decode())[("mmserve_requests_total", (("endpoint", "/v1/chat/completions"),
                                                                       ("status", "200")))] == 1
    assert ("mmserve_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))) not in \
        samples(b.scrape()[0].decode())
    body, content_type = a.scrape("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_ttft_tpot_and_lag_monitor():
    m = ServerMetrics()
    m.observe_tokens(arrival=0.0, previous=None, now=0.2, count=1)  # the first token: TTFT
    m.observe_request(arrival=0.0, end=1.3, finish_reason="length", prompt_tokens=5, completion_tokens=11,
                      first_token=0.2, last_token=1.2)  # TPOT 0.1 s
    m.observe_request(arrival=0.0, end=0.5, finish_reason="abort", prompt_tokens=5, completion_tokens=0)
    count = {h: histogram_buckets(h)[-1][1] for h in (m.ttft, m.request_tpot, m.e2e)}
    assert count == {m.ttft: 1, m.request_tpot: 1, m.e2e: 2}
    assert histogram_quantile(m.request_tpot, 1.0) == 0.1

    async def blocked_loop() -> float:
        mon = LoopLagMonitor(Histogram("lag", "t", buckets=(0.01, 0.1, 1.0), registry=None), interval_s=0.01)
        mon.start()
        await asyncio.sleep(0.03)
        time.sleep(0.15)  # a handler that blocks the loop
        await asyncio.sleep(0.03)
        await mon.stop()
        return mon.max_lag_s

    assert asyncio.run(blocked_loop()) >= 0.1
    assert samples(m.scrape()[0].decode())[("mmserve_time_to_first_token_seconds_count", ())] == 1


def test_speculative_counters_and_accepted_length_histogram():
    snap = a_snapshot(spec_draft_tokens=30, spec_accepted_tokens=18, spec_verify_steps=10,
                      spec_accepted_length=frozen_map({"0": 2, "1": 2, "2": 2, "3": 4}))
    got = samples(ServerMetrics(lambda: snap).scrape()[0].decode())
    assert got[("mmserve_spec_draft_tokens_total", ())] == 30
    assert got[("mmserve_spec_accepted_tokens_total", ())] == 18
    assert got[("mmserve_spec_acceptance_rate", ())] == pytest.approx(0.6)
    assert got[("mmserve_spec_mean_accepted_tokens", ())] == pytest.approx(2.8)
    assert [got[("mmserve_spec_accepted_length_bucket", (("le", le),))] for le in ("0.0", "1.0", "2.0", "3.0", "+Inf")] \
        == [2, 4, 6, 10, 10]
    assert got[("mmserve_spec_accepted_length_sum", ())] == 18
    assert snap.to_dict()["llm"]["spec_acceptance_rate"] == pytest.approx(0.6)


def test_token_counters_and_per_generation_families():
    got = samples(ServerMetrics(lambda: a_snapshot(prompt_tokens=120, generation_tokens=45,
                                                   recomputed_tokens=33)).scrape()[0].decode())
    assert got[("mmserve_prompt_tokens_total", ())] == 120 and got[("mmserve_generation_tokens_total", ())] == 45
    assert got[("mmserve_recomputed_tokens_total", ())] == 33  # apart from the prompt tokens (preemptions)
    m = ServerMetrics()
    m.observe_request(0.0, 0.5, "length", prompt_tokens=30, completion_tokens=7, first_token=0.1, last_token=0.5)
    m.observe_request(0.0, 0.5, "stop", prompt_tokens=600, completion_tokens=2, first_token=0.1, last_token=0.5)
    got = samples(m.scrape()[0].decode())
    assert got[("mmserve_request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("mmserve_request_prompt_tokens_sum", ())] == 630
    assert got[("mmserve_request_generation_tokens_bucket", (("le", "8.0"),))] == 2
    assert got[("mmserve_request_prompt_tokens_bucket", (("le", "512.0"),))] == 1


def later(snap: OmniStats, seconds: float, **llm_fields) -> OmniStats:
    """``snap`` taken ``seconds`` later, with these LLM fields changed."""
    llm = dataclasses.replace(snap.llm, taken_at=snap.llm.taken_at + seconds, **llm_fields)
    return dataclasses.replace(snap, llm=llm, taken_at=snap.taken_at + seconds)


def test_the_stats_line_is_the_interval_and_quiet_when_idle():
    a = a_snapshot(prompt_tokens=1000, generation_tokens=50)
    b = dataclasses.replace(later(a, 10.0, prompt_tokens=3000, generation_tokens=550, preemptions=5,
                                  prefix_cache_hit_tokens=frozen_map({"l1": 564, "l3": 8}),
                                  prefix_cache_query_tokens=1100),
                            encoder_cache_hits=frozen_map({"memory": 10, "disk": 2}), encoder_cache_misses=4)
    line = StatsLogger.line(a, b)
    assert line == ("prompt 200.0 tokens/s, generation 50.0 tokens/s | running 3, waiting 1, in flight 4 | "
                    "KV full 31.2 %, swa 25.0 % | prefix cache hits 50.0 % of 1,000 tokens | "
                    "encoder cache hits 75.0 % of 4 units | preemptions 3")
    # nothing computed, nothing held: no line; an LLM-only snapshot gets the LLM parts
    idle = dataclasses.replace(later(a, 10.0, running=0, queue_depth=0), requests_in_flight=0)
    quiet = dataclasses.replace(a, llm=dataclasses.replace(a.llm, running=0, queue_depth=0), requests_in_flight=0)
    assert StatsLogger.line(quiet, idle) is None
    assert StatsLogger.line(a.llm, b.llm).startswith("prompt 200.0 tokens/s, generation 50.0 tokens/s | "
                                                     "running 3, waiting 1 | KV")
    assert StatsLogger.line(None, b) is None
    assert StatsLogger.line(b, a) is None  # counters going back: another engine's snapshot, no rates


def test_the_stats_logger_writes_a_line_per_busy_interval(caplog):
    base = a_snapshot(prompt_tokens=0)  # then 10 prompt tokens every 0.05 s of snapshot time: 200 a second
    snaps = iter([base] + [later(base, 0.05 * (i + 1), prompt_tokens=10 * (i + 1)) for i in range(100)])

    async def run() -> None:
        stats = StatsLogger(lambda: next(snaps), interval_s=0.01)
        stats.start()
        await asyncio.sleep(0.08)
        await stats.stop()

    with caplog.at_level("INFO", logger="mmserve.stats"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "mmserve.stats"]
    assert len(lines) >= 3 and all(line.startswith("prompt 200.0 tokens/s") for line in lines)


def test_a_snapshot_the_stats_line_cannot_read_skips_the_line_and_the_logger_runs_on(caplog):
    """A stand-in engine (tests, a custom backend) whose stats() is not an OmniStats / EngineStats:
    no line, and the task lives on, so stopping it (the server's lifespan ending) raises nothing."""
    base = a_snapshot(prompt_tokens=0)
    snaps = iter([{}, {}, base] + [later(base, 0.05 * (i + 1), prompt_tokens=10 * (i + 1)) for i in range(100)])

    async def run() -> None:
        stats = StatsLogger(lambda: next(snaps), interval_s=0.01)
        stats.start()
        await asyncio.sleep(0.08)
        assert not stats._task.done()
        await stats.stop()

    with caplog.at_level("INFO", logger="mmserve.stats"):
        asyncio.run(run())
    assert any(r.name == "mmserve.stats" for r in caplog.records)  # lines again once snapshots are readable
