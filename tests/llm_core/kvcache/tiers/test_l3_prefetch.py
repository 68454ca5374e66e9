"""L3 reads off the engine thread (llm_core/kvcache/tiers/l3_prefetch.py): with an L3 store that
takes 200 ms per read, a request whose prefix is in L3 waits in the LOADING state while the others
keep decoding; it then hits, or after the load timeout goes on with what arrived; its greedy tokens
equal a run without any cache either way, and the cache's invariants hold after every step."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.request import RequestStatus
from llm_core.kvcache.swa_radix_cache import SWARadixCache
from llm_core.kvcache.tiers.kv_tiers import KVTiers
from llm_core.kvcache.tiers.l3_prefetch import L3Prefetcher
from llm_core.kvcache.tiers.page_format import store_key
from llm_core.storage import DelayedStore, LocalDirStore, MemoryStore

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 4
MODEL_ID = "prefetch-test"
CONFIG = dict(page_size=PAGE, max_chunk_tokens=8, max_num_batched_tokens=32, num_full_tokens=1024,
              num_swa_tokens=512, prefix_checkpoint_every=8)
SHARED = torch.randint(3, 512, (41,), generator=torch.Generator().manual_seed(7)).tolist()
OTHER = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(8)).tolist()


class SlowStore(DelayedStore):
    """A DelayedStore that records which threads read."""

    def __init__(self, inner, delay_s: float) -> None:
        super().__init__(inner, delay_s)
        self.readers: set[int] = set()

    def get(self, key: str) -> bytes | None:
        self.readers.add(threading.get_ident())
        return super().get(key)


@pytest.fixture(scope="module")
def l3_dir(model, tmp_path_factory):
    """A directory store holding SHARED's KV, written by an engine that served it and closed."""
    root = tmp_path_factory.mktemp("l3")
    engine = LLMEngine(model, EngineConfig(**CONFIG, enable_prefix_caching=True, kv_store=str(root),
                                           kv_model_id=MODEL_ID))
    run(engine, {"w": (SHARED, 4)})
    engine.close()
    return root


def run(engine: LLMEngine, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    for rid, (tokens, n) in prompts.items():
        engine.add_request(rid, tokens, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return out


def slow_engine(model, root, timeout_s: float) -> tuple[LLMEngine, SlowStore]:
    engine = LLMEngine(model, EngineConfig(**CONFIG))
    store = SlowStore(LocalDirStore(root), delay_s=0.2)
    tiers = KVTiers(engine.pool, host=None, store=store, model_id=MODEL_ID, l3_load_timeout_s=timeout_s)
    engine.prefix_cache = engine.scheduler.prefix_cache = SWARadixCache(engine.pool, checkpoint_every=8, tiers=tiers)
    return engine, store


def drive(engine: LLMEngine) -> tuple[dict[str, list[int]], int, int, int]:
    """Decode OTHER alone for a few steps, then add SHARED; step until both finish, checking the
    cache after every step. Returns (tokens, OTHER's tokens while SHARED was loading, steps while
    loading, SHARED's cached tokens)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request("other", OTHER, params)
    for _ in range(3):
        engine.step()
    engine.add_request("shared", SHARED, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    cached = other_tokens_while_loading = loading_steps = 0
    while engine.has_unfinished():
        loading = any(r.status is RequestStatus.LOADING for r in engine.scheduler.waiting)
        loading_steps += loading
        if loading:
            assert engine.stats().kv_l3_loading >= 1  # the snapshot /metrics reads (mmserve_kv_l3_loading)
        for o in engine.step():
            if o.request_id == "other" and loading:
                other_tokens_while_loading += len(o.new_token_ids)
            if o.finished:
                out[o.request_id] = o.token_ids
                cached = o.num_cached_tokens if o.request_id == "shared" else cached
        s = engine.scheduler
        engine.prefix_cache.check_integrity(list(s.running) + [r for r in s.waiting if r.full_pages])
        if loading:
            time.sleep(0.002)  # a tiny model steps in microseconds; let the fetch thread read
    return out, other_tokens_while_loading, loading_steps, cached


@pytest.fixture(scope="module")
def reference(model):
    return run(LLMEngine(model, EngineConfig(**CONFIG)), {"other": (OTHER, 60), "shared": (SHARED, 5)})


def test_slow_l3_reads_run_off_the_engine_thread_and_others_keep_decoding(model, l3_dir, reference):
    engine, store = slow_engine(model, l3_dir, timeout_s=30.0)
    tokens, others, loading_steps, cached = drive(engine)
    assert tokens == reference  # same greedy tokens as without any cache
    assert cached >= 24  # SHARED came back from L3 ...
    assert engine.stats().prefix_cache_hit_tokens.get("l3", 0) >= 24
    assert threading.get_ident() not in store.readers  # ... read by the fetch thread only
    assert loading_steps >= 5 and others >= 5  # OTHER decoded while SHARED was loading
    assert engine.prefix_cache.stats().get("l3_fetch_timeouts", 0) == 0
    engine.close()


def test_a_load_past_its_timeout_goes_on_with_what_arrived(model, l3_dir, reference):
    engine, store = slow_engine(model, l3_dir, timeout_s=0.3)  # one or two of ten 200 ms reads
    t0 = time.monotonic()
    tokens, others, loading_steps, cached = drive(engine)
    assert tokens == reference
    assert engine.prefix_cache.stats()["l3_fetch_timeouts"] >= 1  # (OTHER's one read may time out too)
    assert cached < 24 and loading_steps >= 1
    assert time.monotonic() - t0 < 1.5  # it did not wait for every read (2 s)
    assert engine.stats().prefix_cache["l3_loads_in_flight"] == 0
    engine.close()


# ---- the staged area: bounded without breaking a chain, and the only holder of the rows ----------
def fresh_l3_dir(model, tmp_path) -> str:
    """A directory store holding SHARED's KV with every page's SWA row, this test's own (an
    L3-only engine that closes writes its tree back, and the tree keeps SWA for fewer pages)."""
    engine = LLMEngine(model, EngineConfig(**CONFIG, kv_store=str(tmp_path), kv_model_id=MODEL_ID))
    run(engine, {"w": (SHARED, 4)})
    engine.close()
    return str(tmp_path)


def l3_engine(model, root: str, staged_pages: int | None = None) -> LLMEngine:
    """An engine on ``root`` whose staged area holds ``staged_pages`` pages with their SWA rows."""
    engine = LLMEngine(model, EngineConfig(**CONFIG, kv_store=root, kv_model_id=MODEL_ID))
    tiers = engine.prefix_cache.tiers
    if staged_pages is not None:
        tiers.prefetcher.staged_bytes = staged_pages * (tiers.full_elems + tiers.swa_elems) * 4
    return engine


def test_a_chain_longer_than_the_staged_area_hits_the_prefix_that_fits(model, tmp_path):
    root = fresh_l3_dir(model, tmp_path)
    engine = l3_engine(model, root, staged_pages=6)  # SHARED has 10 whole pages in L3
    cache_off = run(LLMEngine(model, EngineConfig(**CONFIG)), {"shared": (SHARED, 5)})
    assert run(engine, {"shared": (SHARED, 5)}) == cache_off
    stats = engine.prefix_cache.stats()
    assert stats.get("hit_tokens_l3", 0) == 6 * PAGE  # not 0: its tail did not evict its head
    assert stats["l3_staging_full"] == 1  # and it stopped reading past what fits
    prefetcher = engine.prefix_cache.tiers.prefetcher
    assert prefetcher._staged_nbytes <= prefetcher.staged_bytes
    engine.close()


def test_a_matched_job_keeps_no_rows_while_its_request_decodes(model, tmp_path):
    root = fresh_l3_dir(model, tmp_path)
    engine = l3_engine(model, root)
    prefetcher = engine.prefix_cache.tiers.prefetcher
    engine.add_request("shared", SHARED, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while len(tokens) < 3 and time.monotonic() < deadline:  # until the prefill is done and it decodes
        tokens += [t for o in engine.step() for t in o.new_token_ids]
        time.sleep(0.002)
    assert engine.prefix_cache.stats().get("hit_tokens_l3", 0) >= 24
    (job,) = prefetcher._jobs.values()  # the job lives until the request is released ...
    assert len(job.pages) == 0  # ... but its rows went to the staged area, the one bounded holder
    held = {id(t): t for page in prefetcher._staged.values() for t in page if t is not None}
    assert prefetcher._staged_nbytes == sum(t.numel() * t.element_size() for t in held.values())
    engine.close()


class _Request:
    """A stand-in for Request: the prefetcher only uses it as a key."""


def _pages(n: int, tag: bytes) -> list[bytes]:
    return [hashlib.sha256(tag + bytes([i])).digest() for i in range(n)]


def test_staging_evicts_other_jobs_pages_first_and_stops_before_its_own():
    page = 1000  # bytes per page
    store = MemoryStore(1 << 20)
    a, b = _pages(2, b"a"), _pages(4, b"b")
    for h in a + b:
        store.put(store_key(h), bytes(page))
    prefetcher = L3Prefetcher(store, lambda raw: (torch.frombuffer(bytearray(raw), dtype=torch.uint8), None),
                              timeout_s=30.0, staged_bytes=3 * page, num_threads=1)
    jobs = []
    for hashes in (a, b):
        request = _Request()
        prefetcher.start(request, [(h, True) for h in hashes])
        jobs.append(prefetcher._jobs[request])
        jobs[-1].done.wait(10)
        prefetcher.take(request)
    assert list(prefetcher._staged) == b[:3]  # a's pages went for b's; b's 4th did not evict b's 1st
    assert prefetcher._staged_nbytes == 3 * page and prefetcher.counters["l3_staging_full"] == 1
    assert all(len(job.pages) == 0 for job in jobs)  # the staged area holds the rows, the jobs none
    prefetcher.stop()



def test_a_value_that_is_no_page_is_removed_so_the_next_save_replaces_it():
    """Whole for the store (its checksum holds) but not a page of this model: a miss, and removed --
    a save without the SWA row keeps what is there, so left in place it would miss for good."""
    store = MemoryStore(1 << 20)
    h = _pages(1, b"x")[0]
    store.put(store_key(h), b"no page")
    prefetcher = L3Prefetcher(store, lambda raw: None, timeout_s=30.0, num_threads=1)
    request = _Request()
    prefetcher.start(request, [(h, True)])
    prefetcher._jobs[request].done.wait(10)
    assert prefetcher.counters["l3_rejected"] == 1 and store.get(store_key(h)) is None
    prefetcher.stop()

def test_a_save_landing_after_the_read_of_a_value_that_is_no_page_is_kept():
    """The fetch reads a value that is no page of this model; before it removes it, the page's save
    lands (this process's writer, or another process sharing L3). The removal spares that save:
    removing by name dropped the good page, lost from L3 although its writer counted it written."""
    h = _pages(1, b"x")[0]
    good = b"page" * 8

    class SaveAfterRead(MemoryStore):
        def get(self, key: str) -> bytes | None:
            value = super().get(key)
            if value == b"no page":
                self.put(key, good)  # the save, between the fetch's read and its verdict
            return value

    store = SaveAfterRead(1 << 20)
    store.put(store_key(h), b"no page")
    prefetcher = L3Prefetcher(store, lambda raw: raw if raw == good else None, timeout_s=30.0, num_threads=1)
    request = _Request()
    prefetcher.start(request, [(h, True)])
    prefetcher._jobs[request].done.wait(10)
    assert prefetcher.counters["l3_rejected"] == 1
    assert store.get(store_key(h)) == good
    prefetcher.stop()


# ---- a page saved without its SWA row never replaces one stored with it --------------------------
def test_a_page_saved_without_its_swa_row_keeps_the_stored_one_with_it(model, tmp_path):
    """Engine A serves X and stores X's last window with SWA rows. Engine B serves X + more (it did
    not wait for L3) and, having dropped the SWA behind its window, saves X's pages Full-only. X's
    L3 hit must survive B: it did not when B's puts replaced A's entries."""
    config = dict(CONFIG, prefix_checkpoint_every=0, kv_store=str(tmp_path), kv_model_id=MODEL_ID)
    longer = SHARED + OTHER * 4

    def x_hit() -> int:
        engine = LLMEngine(model, EngineConfig(**config))
        run(engine, {"x": (SHARED, 2)})
        hit = engine.prefix_cache.stats().get("hit_tokens_l3", 0)
        engine.close()
        return hit

    a = LLMEngine(model, EngineConfig(**config))
    run(a, {"x": (SHARED, 2)})
    a.close()
    before = x_hit()
    assert before >= len(SHARED) - PAGE
    b = LLMEngine(model, EngineConfig(**config, kv_l3_load_timeout_s=0.0))
    run(b, {"y": (longer, 2)})
    b.prefix_cache.evict(10**9, 10**9)
    b.prefix_cache.tiers.threads.join_writes()
    b.close()
    assert x_hit() == before
