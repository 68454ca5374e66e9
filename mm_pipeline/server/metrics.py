"""Prometheus text exposition for the server, without a client library.

Measured here (the HTTP side sees what the client sees):
  * ``mmserve_time_to_first_token_seconds``   histogram, request arrival -> first token sent
  * ``mmserve_time_per_output_token_seconds`` histogram, (last - first token) / (tokens - 1)
  * ``mmserve_e2e_request_latency_seconds``   histogram
  * ``mmserve_requests_total{endpoint,status}`` counter
  * ``mmserve_event_loop_lag_seconds``        histogram (+ ``_max`` gauge) from ``LoopLagMonitor``
Engine state comes from ``engine.stats()`` at scrape time and is rendered by ``render_engine_stats``:
queue depth, running requests, KV pool usage per pool, prefix / encoder cache hits per tier.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections import defaultdict
from typing import Any, Iterable, Mapping

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics); thread-safe."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        with self._lock:
            self._sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self._counts[i] += 1
                    break
            else:
                self._counts[-1] += 1

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (inf when it is in the +Inf bucket)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile wants 0 <= q <= 1, got {q}")
        with self._lock:
            counts = list(self._counts)
        total = sum(counts)
        if total == 0:
            return 0.0
        running = 0
        for b, c in zip(self.buckets + (float("inf"),), counts):
            running += c
            if running >= q * total:
                return b
        return float("inf")

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for b, c in zip(self.buckets, counts):
            running += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {running}')
        running += counts[-1]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {running}', f"{self.name}_sum {total}",
                  f"{self.name}_count {running}"]
        return lines


class LoopLagMonitor:
    """Measures how late the event loop wakes a sleeper: the time any callback blocked it."""

    def __init__(self, histogram: Histogram, interval_s: float = 0.05) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self.max_lag_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t0 - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, lag)
            self.histogram.observe(lag)


class ServerMetrics:
    """Everything the HTTP layer measures; ``render(engine_stats)`` -> Prometheus text."""

    def __init__(self) -> None:
        self.ttft = Histogram("mmserve_time_to_first_token_seconds",
                              "Request arrival to first generated token", LATENCY_BUCKETS)
        self.tpot = Histogram("mmserve_time_per_output_token_seconds",
                              "Mean time between output tokens of a request", TOKEN_BUCKETS)
        self.e2e = Histogram("mmserve_e2e_request_latency_seconds", "Request arrival to last token",
                             LATENCY_BUCKETS)
        self.loop_lag = Histogram("mmserve_event_loop_lag_seconds", "Event loop wake-up delay", LAG_BUCKETS)
        self.lag_monitor = LoopLagMonitor(self.loop_lag)
        self._requests: dict[tuple[str, int], int] = defaultdict(int)
        self._lock = threading.Lock()
        self.in_flight = 0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, status)] += 1

    def observe_request(self, arrival: float, first_token: float | None, end: float, completion_tokens: int) -> None:
        """Record one finished generation (times from ``time.perf_counter``)."""
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((end - first_token) / (completion_tokens - 1))

    def render(self, engine_stats: Mapping[str, Any] | None) -> str:
        lines: list[str] = []
        for h in (self.ttft, self.tpot, self.e2e, self.loop_lag):
            lines += h.render()
        lines += ["# HELP mmserve_event_loop_lag_max_seconds Largest event loop lag seen",
                  "# TYPE mmserve_event_loop_lag_max_seconds gauge",
                  f"mmserve_event_loop_lag_max_seconds {self.lag_monitor.max_lag_s}",
                  "# TYPE mmserve_http_requests_in_flight gauge",
                  f"mmserve_http_requests_in_flight {self.in_flight}",
                  "# TYPE mmserve_requests_total counter"]
        with self._lock:
            reqs = sorted(self._requests.items())
        for (endpoint, status), n in reqs:
            lines.append(f'mmserve_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        if engine_stats:
            lines += render_engine_stats(engine_stats)
        return "\n".join(lines) + "\n"


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
# Nested stats whose keys are label values, not metric names: {"kv_pool": {"full": {...}, "swa": {...}}}.
_LABELLED = {"kv_pool": "pool", "kv_pools": "pool", "pools": "pool", "encoder_cache": "tier",
             "prefix_cache": "tier", "tiers": "tier"}


def _metric_name(parts: list[str]) -> str:
    return "mmserve_" + "_".join(_NAME_BAD.sub("_", p).strip("_").lower() for p in parts if p)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(34), "")}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def render_engine_stats(stats: Mapping[str, Any]) -> list[str]:
    """Flatten ``engine.stats()`` into gauges.  Numbers become samples; a nested mapping under a
    known grouping key (``kv_pool``, ``encoder_cache``, ``prefix_cache``...) turns its keys into a
    ``pool`` / ``tier`` label so per-pool and per-tier values share one metric name."""
    samples: dict[str, list[str]] = defaultdict(list)

    def walk(value: Any, path: list[str], labels: dict[str, str]) -> None:
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                samples[_metric_name(path)].append(f"{_metric_name(path)}{_labels(labels)} {value}")
            return
        if not isinstance(value, Mapping):
            return  # strings, lists: not metrics
        label = _LABELLED.get(path[-1]) if path else None
        for k, v in value.items():
            if label is not None and label not in labels and isinstance(v, Mapping):
                walk(v, path, {**labels, label: str(k)})
            else:
                walk(v, path + [str(k)], labels)

    walk(stats, [], {})
    lines: list[str] = []
    for name in sorted(samples):
        lines.append(f"# TYPE {name} gauge")
        lines += samples[name]
    return lines
