"""``/metrics`` through prometheus_client: one registry per app, scraped with its exposition.

Measured here (the HTTP side sees what the client sees), per generation (each of a request's
choices), for every request however it ended (server/request_observer.py):
  * ``mmserve_time_to_first_token_seconds``   histogram, request arrival -> first token, when it comes
  * ``mmserve_inter_token_latency_seconds``   histogram, every gap between a generation's tokens
  * ``mmserve_request_time_per_output_token_seconds`` histogram, (last - first token) / (tokens - 1)
  * ``mmserve_e2e_request_latency_seconds``   histogram, request arrival -> the generation's end
  * ``mmserve_request_success_total{finished_reason}`` counter ("abort": cut short), and the
    ``mmserve_request_{prompt,generation}_tokens`` histograms
  * ``mmserve_requests_total{endpoint,status}`` counter, ``mmserve_http_requests_in_flight`` gauge
  * ``mmserve_event_loop_lag_seconds``        histogram (+ ``_max`` gauge) from ``LoopLagMonitor``
Engine state is the engine's last published snapshot (mm_pipeline/runtime/stats.py), turned into
metric families at scrape time by :class:`SnapshotCollector`: queue depth, running requests, KV pool
pages, tokens and bytes per pool (the split), the context one request can hold, prefix / encoder
cache hits per tier, decode pool, engine-loop counters. A counter is a counter family (exposed
with ``_total``), a current value a gauge, in the count maps too (``_counts``: the keys named in
``*_GAUGES`` are gauges, every other key counts up).

The registry is the app's own (``CollectorRegistry``), not prometheus_client's global one, so
several apps in one process (tests, benchmarks) do not clash.

Multiprocess mode (several server processes behind one port), when it is wanted: set
``PROMETHEUS_MULTIPROC_DIR`` before prometheus_client is first imported; the histograms, counters
and gauges below then live in files shared by the processes (each gauge already says how to merge
with ``multiprocess_mode``), and :meth:`ServerMetrics.scrape` must expose a fresh
``CollectorRegistry()`` fed by ``prometheus_client.multiprocess.MultiProcessCollector`` instead of
``self.registry``. The snapshot collector reads this process's engine only: with one engine per
process, add a ``pid`` label to its families (or mirror them into ``livesum`` gauges on publish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from llm_core.engine.stats import EngineStats
from mm_pipeline.runtime.stats import OmniStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TOKEN_COUNT_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
PREFIX = "mmserve_"
# the keys of the engine's count maps that are current values (gauges); every other key counts up
PREFIX_CACHE_GAUGES = frozenset({"tree_nodes", "tree_full_pages", "tree_swa_pages", "tree_tombstones", "l2_entries",
                                 "l3_write_queue_bytes", "l3_loads_in_flight"})
ENCODER_CACHE_GAUGES = frozenset({"pending_writes"})
ENCODER_GAUGES = frozenset({"pending", "in_flight_units"})


def histogram_buckets(h: Histogram) -> list[tuple[float, float]]:
    """``(upper bound, cumulative count)`` per bucket, ``+Inf`` last, as the histogram exposes them."""
    return [(float(s.labels["le"]), s.value) for m in h.collect() for s in m.samples if s.name.endswith("_bucket")]


def histogram_quantile(h: Histogram, q: float) -> float:
    """Upper bound of the bucket holding the q-quantile (inf when it is in the +Inf bucket; 0.0
    with no observations) -- what a benchmark can read without a Prometheus server."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile wants 0 <= q <= 1, got {q}")
    buckets = histogram_buckets(h)
    total = buckets[-1][1]
    if total == 0:
        return 0.0
    return next(bound for bound, running in buckets if running >= q * total)


class LoopTask:
    """A coroutine (``_run``) the app's event loop runs from ``start`` to ``stop`` (the lifespan)."""

    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        raise NotImplementedError


class LoopLagMonitor(LoopTask):
    """Measures how late the event loop wakes a sleeper: the time any callback blocked it."""

    def __init__(self, histogram: Histogram, interval_s: float = 0.05, max_gauge: Gauge | None = None) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self.max_gauge = max_gauge
        self.max_lag_s = 0.0  # a benchmark may reset it to measure one phase

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t0 - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, lag)
            self.histogram.observe(lag)
            if self.max_gauge is not None:
                self.max_gauge.set(self.max_lag_s)


class StatsLogger(LoopTask):
    """vLLM's periodic engine line, for an operator reading the log: every ``interval_s`` in which
    the engine did anything (or holds requests), one INFO line on ``mmserve.stats`` with the
    interval's prompt and generation throughput, the requests running and waiting, KV pool use,
    the interval's prefix- and encoder-cache hit rates and preemptions. Quiet while idle. Reads the
    published snapshots only (``/metrics`` has every number behind it)."""

    def __init__(self, snapshot: Callable[[], Any], interval_s: float,
                 logger: logging.Logger | None = None) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.log = logger or logging.getLogger("mmserve.stats")
        self._last: Any = None

    def start(self) -> None:
        self._last = self._read()
        super().start()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = self._read()
            try:
                text = self.line(self._last, now)
            except Exception as exc:  # noqa: BLE001 -- a snapshot of another shape (a stand-in engine):
                # the operator's line is skipped; it must never end the task, and with it the lifespan
                log.debug("no stats line for this interval: %s", exc)
                text = None
            if text is not None:
                self.log.info("%s", text)
            if now is not None:
                self._last = now

    def _read(self) -> Any:
        try:
            return self.snapshot()
        except Exception as exc:  # noqa: BLE001 -- a Ray ingress whose replicas do not answer: skip a line
            log.debug("engine stats unavailable for the stats line: %s", exc)
            return None

    @staticmethod
    def line(before: Any, now: Any) -> str | None:
        """The line for the interval between two snapshots (OmniStats or EngineStats), or None when
        nothing ran in it and nothing is held."""
        if before is None or now is None:
            return None
        omni = isinstance(now, OmniStats)
        a, b = (before.llm, now.llm) if omni else (before, now)
        seconds = b.taken_at - a.taken_at
        prompt, generated = b.prompt_tokens - a.prompt_tokens, b.generation_tokens - a.generation_tokens
        if seconds <= 0 or prompt < 0 or generated < 0:  # not the same engine's later snapshot: no rates
            return None
        if not (prompt or generated or b.running or b.queue_depth or (omni and now.requests_in_flight)):
            return None
        parts = [f"prompt {prompt / seconds:,.1f} tokens/s, generation {generated / seconds:,.1f} tokens/s",
                 f"running {b.running}, waiting {b.queue_depth}" + (
                     f", in flight {now.requests_in_flight}" if omni else ""),
                 "KV " + ", ".join(f"{name} {100 * u.used_pages / max(u.total_pages, 1):.1f} %"
                                   for name, u in b.kv_pool.items())]
        queried = b.prefix_cache_query_tokens - a.prefix_cache_query_tokens
        if queried:
            hits = sum(b.prefix_cache_hit_tokens.values()) - sum(a.prefix_cache_hit_tokens.values())
            parts.append(f"prefix cache hits {100 * hits / queried:.1f} % of {queried:,} tokens")
        if omni:
            hits = sum(now.encoder_cache_hits.values()) - sum(before.encoder_cache_hits.values())
            looked = hits + now.encoder_cache_misses - before.encoder_cache_misses
            if looked:
                parts.append(f"encoder cache hits {100 * hits / looked:.1f} % of {looked:,} units")
        if b.preemptions > a.preemptions:
            parts.append(f"preemptions {b.preemptions - a.preemptions}")
        return " | ".join(parts)


class ServerMetrics:
    """Everything ``/metrics`` exposes, registered in ``self.registry``; ``scrape`` renders it."""

    def __init__(self, snapshot: Callable[[], Any] | None = None) -> None:
        """``snapshot`` returns the engine's last published stats (``OmniEngine.stats``)."""
        self.registry = CollectorRegistry()
        r = self.registry
        # per generation (each choice of a request), as vLLM's families of these names
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to a generation's first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive tokens of a generation",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.request_tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                                      "Mean time between the output tokens of a generation", buckets=TOKEN_BUCKETS,
                                      registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to a generation's end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram(PREFIX + "event_loop_lag_seconds", "Event loop wake-up delay", buckets=LAG_BUCKETS,
                                  registry=r)
        lag_max = Gauge(PREFIX + "event_loop_lag_max_seconds", "Largest event loop lag seen", registry=r,
                        multiprocess_mode="max")
        self.lag_monitor = LoopLagMonitor(self.loop_lag, max_gauge=lag_max)
        self.http_in_flight = Gauge(PREFIX + "http_requests_in_flight", "HTTP requests being handled", registry=r,
                                    multiprocess_mode="livesum")
        self.requests = Counter(PREFIX + "requests", "HTTP responses by route and status", ["endpoint", "status"],
                                registry=r)
        self.finished = Counter(PREFIX + "request_success", "Generations finished, by why they ended",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens of a generation",
                                       buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Tokens a generation produced",
                                           buckets=TOKEN_COUNT_BUCKETS, registry=r)
        if snapshot is not None:
            r.register(SnapshotCollector(snapshot))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_tokens(self, arrival: float, previous: float | None, now: float, count: int) -> None:
        """``count`` tokens of one generation came at ``now`` (times from ``time.perf_counter``): its
        first ones (``previous`` None) give its time to first token, later ones the gap since its
        ``previous`` tokens, shared evenly among them. Several tokens come in one output when a
        consumer fell behind (``OmniEngine.outputs`` hands it the queued steps as one) or a
        speculative step accepted drafts: their times apart are not known here, and counting them
        as gaps of zero made the median read 0 under load, when the metric matters most. Sharing
        keeps what is known: the histogram counts tokens - 1 gaps per generation and sums to last -
        first token time, the per-request mean's numerator. Tokens that come with the first have no
        earlier time to share: gaps of zero. (vLLM v1 observes one interval per engine step instead;
        with a token a step and a consumer that keeps up they agree.)"""
        if previous is None:
            self.ttft.observe(now - arrival)
            for _ in range(count - 1):
                self.itl.observe(0.0)
            return
        for _ in range(count):
            self.itl.observe((now - previous) / count)

    def observe_request(self, arrival: float, end: float, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, first_token: float | None = None,
                        last_token: float | None = None) -> None:
        """Record one ended generation: ``end`` is its own (a request's n choices end apart), times
        from ``time.perf_counter``; its time to first token was observed when the token came."""
        self.finished.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(completion_tokens)
        self.e2e.observe(end - arrival)
        if first_token is not None and last_token is not None and completion_tokens > 1:
            self.request_tpot.observe((last_token - first_token) / (completion_tokens - 1))

    def scrape(self, accept: str | None = None) -> tuple[bytes, str]:
        """``(body, content type)`` in the format the ``Accept`` header asks for (Prometheus text
        by default, OpenMetrics on request)."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class SnapshotCollector:
    """A custom collector: the engine's last snapshot as metric families, read at scrape time."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshot; nothing to check against the fixed metrics above

    def collect(self) -> Iterator[Metric]:
        # a snapshot that cannot be had (a Ray ingress whose replicas stopped answering: /health is
        # 503 then) leaves the engine's families out of the scrape, not the whole scrape failing:
        # the server's own metrics are what tell an operator what happened
        try:
            s = self.snapshot()
        except Exception as exc:  # noqa: BLE001 -- any failure: reported by the gauge and a log line
            log.debug("engine stats unavailable at scrape: %s", exc)
            yield _gauge("engine_stats_available", "1 when the engine's statistics could be read at this scrape", 0)
            return
        yield _gauge("engine_stats_available", "1 when the engine's statistics could be read at this scrape", 1)
        if isinstance(s, OmniStats):
            yield from _omni_families(s)
        elif isinstance(s, EngineStats):
            yield from _engine_families(s)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _labelled(family: type, name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    m = family(PREFIX + name, doc, labels=[label])
    for key, v in sorted(values.items()):
        m.add_metric([str(key)], v)
    return m


def _counts(group: str, doc: str, counts: Mapping[str, int], gauges: frozenset[str] = frozenset()) -> Iterator[Metric]:
    """A count map kept under its owner's key names: ``name`` -> ``<group>_<name>``, and
    ``name.kind`` -> ``<group>_<name>{kind="kind"}`` (one family per name); a name in ``gauges``
    is a gauge, any other a counter (exposed as ``<group>_<name>_total``)."""
    by_name: dict[str, dict[str, float]] = {}
    for key, v in counts.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            name, _, kind = key.partition(".")
            by_name.setdefault(name, {})[kind] = v
    for name, values in sorted(by_name.items()):
        full = f"{group}_{name}"
        family = GaugeMetricFamily if name in gauges else CounterMetricFamily
        if set(values) == {""}:
            yield family(PREFIX + full, doc, value=values[""])
        else:
            yield _labelled(family, full, doc, "kind", {k or "all": v for k, v in values.items()})


def _engine_families(s: EngineStats) -> Iterator[Metric]:
    yield _gauge("running", "Requests the scheduler is computing", s.running)
    yield _gauge("queue_depth", "Requests waiting to be scheduled", s.queue_depth)
    yield _gauge("kv_l3_loading", "Waiting requests whose cached prefix is being read from L3", s.kv_l3_loading)
    yield _counter("preemptions", "Requests preempted for KV pages", s.preemptions)
    yield _counter("prompt_tokens", "Prompt tokens not supplied by the prefix cache at each request's first admission (usage's prompt - cached)",
                   s.prompt_tokens)
    yield _counter("generation_tokens", "Tokens generated", s.generation_tokens)
    yield _counter("recomputed_tokens", "Tokens computed again after preemptions (not prompt_tokens)",
                   s.recomputed_tokens)
    yield _gauge("kv_page_size_tokens", "Tokens per KV page", s.kv_page_size)
    for field in ("total_pages", "used_pages", "free_pages", "peak_pages", "total_bytes"):
        yield _labelled(GaugeMetricFamily, f"kv_pool_{field}", f"KV pool {field.replace('_', ' ')}", "pool",
                        {name: getattr(u, field) for name, u in s.kv_pool.items()})
    # the split in tokens, as the start-up prints it (docs/kv_cache.md §1, "Sizing")
    yield _labelled(GaugeMetricFamily, "kv_pool_total_tokens", "KV pool size in tokens", "pool",
                    {name: u.total_pages * s.kv_page_size for name, u in s.kv_pool.items()})
    yield _gauge("max_context_tokens", "Longest prompt + output one request can hold", s.max_context_tokens)
    yield _labelled(CounterMetricFamily, "prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache",
                    "tier", s.prefix_cache_hit_tokens)
    yield _counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                   s.prefix_cache_query_tokens)
    yield _labelled(CounterMetricFamily, "prefix_cache_evicted_pages", "KV pages evicted from the prefix cache",
                    "pool", s.prefix_cache_evicted_pages)
    yield from _counts("prefix_cache", "Prefix cache count", s.prefix_cache, PREFIX_CACHE_GAUGES)
    yield from _spec_families(s)


def _spec_families(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding (MTP): counters, the acceptance rate and the accepted-length histogram
    (one observation per request per verify step: the draft tokens it accepted)."""
    yield _counter("spec_draft_tokens", "MTP draft tokens proposed", s.spec_draft_tokens)
    yield _counter("spec_accepted_tokens", "MTP draft tokens accepted by the target", s.spec_accepted_tokens)
    yield _counter("spec_verify_steps", "Request steps that verified MTP draft tokens", s.spec_verify_steps)
    yield _gauge("spec_acceptance_rate", "Accepted / proposed MTP draft tokens since start", s.spec_acceptance_rate)
    yield _gauge("spec_mean_accepted_tokens", "Tokens emitted per verify step since start (accepted + bonus)",
                 s.spec_mean_accepted_tokens)
    counts = sorted((int(a), n) for a, n in s.spec_accepted_length.items())
    hist = HistogramMetricFamily(PREFIX + "spec_accepted_length", "Draft tokens accepted per verify step")
    cumulative, buckets = 0, []
    for a, n in counts:
        cumulative += n
        buckets.append((str(float(a)), cumulative))
    hist.add_metric([], buckets + [("+Inf", cumulative)], sum_value=float(sum(a * n for a, n in counts)))
    yield hist


def _omni_families(s: OmniStats) -> Iterator[Metric]:
    yield from _engine_families(s.llm)
    yield _gauge("requests_in_flight", "Requests admitted and not finished", s.requests_in_flight)
    yield _gauge("requests_in_flight_limit", "Admitted requests beyond which new ones get 429",
                 s.requests_in_flight_limit)
    yield _gauge("engine_loop_requests", "Requests the engine loop delivers outputs to", s.engine_loop_requests)
    yield from _counts("engine_loop", "Engine loop count", s.engine_loop)
    yield _labelled(CounterMetricFamily, "encoder_cache_hits", "Encoder cache hits", "tier", s.encoder_cache_hits)
    yield _counter("encoder_cache_misses", "Encoder cache misses", s.encoder_cache_misses)
    yield from _counts("encoder_cache", "Encoder cache count", s.encoder_cache, ENCODER_CACHE_GAUGES)
    yield from _counts("encoder", "Encoder batcher count", s.encoder, ENCODER_GAUGES)
    yield from _counts("media", "Media work count", s.media)
    yield _gauge("decode_pool_admitted", "Media calls running or queued on the decode workers",
                 s.decode_pool_admitted)
    yield _gauge("decode_pool_waiting", "Media calls waiting for a decode worker slot", s.decode_pool_waiting)
    yield _labelled(GaugeMetricFamily, "intra_op_threads", "Intra-op threads a thread runs at", "thread",
                    s.intra_op_threads)
    yield _gauge("stats_age_seconds", "Age of the engine snapshot at scrape time", time.monotonic() - s.taken_at)
