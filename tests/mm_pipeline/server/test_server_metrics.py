"""Prometheus text from the server: histogram semantics, engine stats with per-pool / per-tier
labels, and the event-loop lag monitor noticing a blocked loop."""

from __future__ import annotations

import asyncio
import time

from hypothesis import given
from hypothesis import strategies as st

from mm_pipeline.server.metrics import Histogram, LoopLagMonitor, ServerMetrics, render_engine_stats


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative(values):
    h = Histogram("x_seconds", "test", (0.1, 1.0, 10.0))
    for v in values:
        h.observe(v)
    lines = h.render()
    counts = [int(ln.split()[-1]) for ln in lines if ln.startswith("x_seconds_bucket")]
    assert counts == [sum(v <= b for v in values) for b in (0.1, 1.0, 10.0)] + [len(values)]
    assert f"x_seconds_count {len(values)}" in lines
    if values:
        q = h.quantile(0.5)
        below = sum(v <= q for v in values)
        assert below >= len(values) / 2  # the bucket bound holds at least half of the samples


def test_engine_stats_become_labelled_gauges():
    stats = {"running": 3, "waiting": 1, "queue_depth": 1, "flag": True, "name": "ignored",
             "kv_pool": {"full": {"used_pages": 5, "free_pages": 11}, "swa": {"used_pages": 2, "free_pages": 6}},
             "encoder_cache": {"memory": {"hits": 7}, "disk": {"hits": 2}},
             "prefix_cache": {"hits": 4, "hit_tokens": 64}, "engine_loop": {"steps": 9}}
    text = "\n".join(render_engine_stats(stats))
    for sample in ("mmserve_running 3", "mmserve_queue_depth 1", "mmserve_flag 1",
                   'mmserve_kv_pool_free_pages{pool="full"} 11', 'mmserve_kv_pool_used_pages{pool="swa"} 2',
                   'mmserve_encoder_cache_hits{tier="memory"} 7', 'mmserve_encoder_cache_hits{tier="disk"} 2',
                   "mmserve_prefix_cache_hits 4", "mmserve_engine_loop_steps 9"):
        assert sample in text, sample
    assert "ignored" not in text
    assert text.count("# TYPE mmserve_kv_pool_free_pages gauge") == 1  # one family, two labelled samples


def test_ttft_tpot_and_lag_monitor():
    m = ServerMetrics()
    m.observe_request(arrival=0.0, first_token=0.2, end=1.2, completion_tokens=11)  # TPOT 0.1 s
    m.observe_request(arrival=0.0, first_token=None, end=0.5, completion_tokens=0)
    assert m.ttft.count == 1 and m.tpot.count == 1 and m.e2e.count == 2
    assert m.tpot.quantile(1.0) == 0.1

    async def blocked_loop() -> float:
        mon = LoopLagMonitor(Histogram("lag", "t", (0.01, 0.1, 1.0)), interval_s=0.01)
        mon.start()
        await asyncio.sleep(0.03)
        time.sleep(0.15)  # a handler that blocks the loop
        await asyncio.sleep(0.03)
        await mon.stop()
        return mon.max_lag_s

    assert asyncio.run(blocked_loop()) >= 0.1
    text = m.render({"running": 0})
    assert "mmserve_time_to_first_token_seconds_count 1" in text and "mmserve_running 0" in text
