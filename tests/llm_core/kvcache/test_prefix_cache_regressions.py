"""One deterministic scenario per bug class peers shipped in hybrid-SWA prefix caching (docs/kv_cache.md, "Bug classes").

Each scenario runs on the fingerprinting harness of test_swa_radix_cache (a wrong or freed slot read by
any step fails there) and checks exact page reference counts after every step.
"""

from __future__ import annotations

from types import SimpleNamespace

from llm_core.engine.queue_policy import QueuePolicy
from llm_core.engine.request import Request
from llm_core.engine.sampling import SamplingParams
from tests.llm_core.kvcache.test_swa_radix_cache import BASES, Harness
from tests.llm_core.kvcache.tiers.test_kv_tiers import tiers


def run(h: Harness, prompt: list[int], max_tokens: int = 4):
    r = h.add(prompt, max_tokens)
    h.drain()
    return r


def test_stale_mapping_never_frees_a_live_slot():
    """SGLang #27586: a tombstoned node kept a stale SWA mapping and later freed a slot someone else
    owned. Here: tombstone everything, hand every SWA page to a new owner, then release everything the
    cache knows about; the new owner's pages must keep exactly its one reference."""
    h = Harness(window=4, page=2, full_pages=64, swa_pages=16, checkpoint=4, budget=6)
    for n in (20, 14, 26):
        run(h, BASES[0][:n])
    assert h.cache.stats()["tree_swa_pages"] > 0
    h.cache.evict(0, 10_000)  # tombstone / delete every unlocked SWA page
    assert h.cache.stats()["tree_swa_pages"] == 0
    owned = h.pool.swa.allocate(h.pool.swa.num_free - 8)  # the new owner takes (most of) the freed pages
    h.external.append(SimpleNamespace(full_pages=[], swa_pages=owned))
    again = run(h, BASES[0][:20])  # walks over the tombstones and revives them with its own pages
    assert again.finish_reason == "length"
    h.cache.clear()
    assert all(h.pool.swa.refcount(p) == 1 for p in owned)
    h.pool.swa.free(owned)
    assert h.pool.all_free()


def test_stale_mapping_after_revival_by_another_request():
    """A request's trim duty must not free a page that replaced its own contribution (tombstoned and
    revived with another request's page in between)."""
    h = Harness(window=2, page=1, full_pages=128, swa_pages=64, interval=50)
    prompt = BASES[1][:30]
    a = h.add(prompt, 8)
    h.step()  # a computes its prompt in chunks of 16 -> pages behind its window are trimmed
    h.cache.evict(0, 10_000)
    b = h.add(prompt, 8)  # re-computes what was tombstoned and revives it with its own pages
    h.drain()
    assert a.finish_reason == b.finish_reason == "length"
    h.cache.clear()
    assert h.pool.all_free()


def test_last_leaf_keeps_swa_when_page_larger_than_window():
    """SGLang #29860: with page_size > window the last leaf was tombstoned, so the finished sequence
    could never be matched again."""
    for window, page in ((2, 8), (3, 4), (1, 4)):
        h = Harness(window=window, page=page, full_pages=64, swa_pages=16)
        prompt = BASES[2][:29]
        run(h, prompt)
        leaves = [n for n in h.cache.tree.nodes() if n.is_leaf]
        assert leaves and all(not n.is_tombstone and n.swa[-1] >= 0 for n in leaves)
        again = run(h, prompt)  # same prompt: hits up to its last whole page
        assert again.num_cached_tokens == (len(prompt) - 1) // page * page


def test_eviction_tombstones_idle_swa_instead_of_reporting_full():
    """SGLang #29662: decode failed with "KV full" because eviction ignored SWA held by tombstone-able
    internal nodes while hundreds of thousands of SWA slots sat idle. Here the SWA pool is full of cached
    checkpoint windows; new requests must get SWA pages by tombstoning them, keeping the Full KV."""
    h = Harness(window=4, page=2, full_pages=256, swa_pages=20, checkpoint=4, budget=8, seqs=2)
    for n in (40, 44, 48):
        run(h, BASES[0][:n], max_tokens=2)
    # 16-18 of 20 SWA pages hold cached windows (eviction during the runs took only what each step
    # needed); the two newcomers need about 2 x 7 pages at once
    assert h.cache.stats()["tree_swa_pages"] >= 16 and h.pool.swa.num_free <= 4
    used_full = h.pool.full.num_used
    others = [h.add(BASES[1][:30], 8), h.add(BASES[2][:30], 8)]
    h.drain()
    assert all(r.finish_reason == "length" for r in others)
    assert h.sched.num_preemptions == 0
    stats = h.cache.stats()
    assert stats["evicted_swa_pages"] > 0 and stats["tombstoned_nodes"] > 0
    assert stats.get("evicted_full_pages", 0) == 0 and h.pool.full.num_used > used_full


def test_unfinished_request_bookkeeping_survives_preemption():
    """SGLang #30845 / #36909: the evicted-SWA length of an unfinished request was lost when it was
    re-cached. Here requests are inserted after every chunk and preempted mid-decode with part of their
    SWA released; what the tree keeps must be exactly the valid pages and the re-admitted request must
    resume from a window-safe point (the harness checks every visible key)."""
    h = Harness(window=3, page=2, full_pages=26, swa_pages=24, budget=6, chunk=4, interval=1, seqs=3)
    reqs = [h.add(BASES[i][:18], 10) for i in range(3)]
    h.drain()
    assert h.sched.num_preemptions > 0
    assert all(r.finish_reason == "length" and r.num_output_tokens == 10 for r in reqs)
    assert any(r.num_cached_tokens > 0 for r in reqs if r.num_preemptions)
    h.cache.clear()
    assert h.pool.all_free()


def test_queue_order_prefers_fewer_uncached_tokens_and_nobody_starves():
    def req(i, n, waited):
        r = Request(f"q{i}", list(range(1, n + 1)), SamplingParams(), i)
        r.arrival_time = 100.0 - waited
        return r

    long_old, short_new, cached_long = req(0, 9000, 0.5), req(1, 1500, 0.0), req(2, 8000, 0.0)
    hits = {cached_long: 7900}
    order = QueuePolicy("fewest_uncached", 1000.0).order([long_old, short_new, cached_long], lambda r: hits.get(r, 0),
                                                         now=100.0)
    assert order == [cached_long, short_new, long_old]  # 100 uncached < 1500 < 9000 - 500
    long_old.arrival_time = 100.0 - 8.0  # waited 8 s: 9000 - 8000 = 1000 < 1500
    order = QueuePolicy("fewest_uncached", 1000.0).order([long_old, short_new, cached_long], lambda r: hits.get(r, 0),
                                                         now=100.0)
    assert order == [cached_long, long_old, short_new]
    assert QueuePolicy("fcfs").order([long_old, short_new], lambda r: 0, 100.0) == [long_old, short_new]


def test_fewest_uncached_serves_a_cached_request_first_on_the_engine_path():
    h = Harness(window=4, page=2, full_pages=256, swa_pages=64, budget=8, seqs=1)
    h.sched.queue_policy = QueuePolicy("fewest_uncached", 0.0)
    run(h, BASES[0][:40])
    fresh, cached = h.add(BASES[1][:20], 2), h.add(BASES[0][:40] + [5, 6, 7], 2)
    h.step()
    assert cached.status.value == "running" and fresh.status.value == "waiting"
    h.drain()
    assert cached.num_cached_tokens == 40 and fresh.finish_reason == "length"


def test_a_long_chunk_does_not_pin_its_checkpoint_windows():
    """A chunk longer than the SWA pool's spare room, with a checkpoint window every page or two: the
    chunk's pages behind the window are a node of their own, which the request's SWA lock leaves,
    so their checkpoint windows can be evicted for the request's next step. As one node they stayed
    locked while the window overlapped its end, and a lone request failed ("does not fit in the KV
    pools even alone") where the cache off finishes it."""
    for checkpoint in (4, 8):
        h = Harness(window=8, page=4, full_pages=64, swa_pages=8, checkpoint=checkpoint, budget=64)
        r = run(h, BASES[0][:40], max_tokens=4)
        assert r.finish_reason == "length", (checkpoint, r.finish_reason)
        h.cache.clear()
        assert h.pool.all_free()


def test_a_prefix_computed_again_is_held_once():
    """A request that computes a prefix the tree already holds (it matched nothing: the SWA behind
    the first request's window was trimmed) puts its own Full pages on the tree's nodes and the tree
    lets its copies go: the prefix takes its pages once. The tree used to keep its copies, locked by
    the request that did not read them, and with a tight Full pool the lone request failed part-way."""
    h = Harness(window=8, page=4, full_pages=16, swa_pages=64, budget=16)
    first = BASES[1][:40]
    run(h, first, max_tokens=1)
    again = h.add(first[:20] + BASES[2][:4], 36)  # 24 + 36 tokens = 15 of the 16 Full pages
    for _ in range(12):
        h.step()
        h.check()
        tree_full, _ = h.cache.tree.check_integrity(True)
        assert h.pool.full.num_used == len(tree_full | set(again.full_pages))
        if again.num_computed_tokens >= 24:  # its prompt is on the tree: every page of it is its own
            assert set(again.full_pages[:5]) <= tree_full
    h.drain()
    assert again.num_cached_tokens == 0 and again.finish_reason == "length"


def test_a_window_computed_again_is_held_once():
    """The same for SWA: a request that computes a prefix again (here it takes nothing from the
    tree: prompt logprobs) gives a node its SWA page where the node kept its own for a window and
    nobody else reads it; with a small SWA pool the two copies, both locked by the request, left
    nothing to evict."""
    h = Harness(window=4, page=4, full_pages=64, swa_pages=16, budget=20)
    first = BASES[1][:21]
    run(h, first, max_tokens=1)
    kept = {n.start + i for n in h.cache.tree.nodes() for i, s in enumerate(n.swa) if s >= 0}
    assert 4 in kept  # the window ending at the first prompt's last whole page (20 tokens)
    again = Request("again", first[:20] + BASES[2][:6], SamplingParams(max_tokens=2, prompt_logprobs=1), 99)
    h.requests.append(again)
    h.sched.add(again)
    h.step()  # 20 tokens: its window is the one the tree kept
    h.check()
    assert again.num_cached_tokens == 0 and again.num_computed_tokens == 20 and again.swa_pages[4] >= 0
    node, i = h.cache.locks.get(again).tail.locate(4)
    assert node.swa[i] == again.swa_pages[4] and h.pool.swa.num_used == 1  # the window is held once
    h.drain()
    assert again.finish_reason == "length"


def test_a_match_extended_by_a_load_leaves_the_shorter_windows_swa_evictable():
    """While a tier load extends a match, the shorter L1 match's window is SWA-locked too (the
    fallback, should the load find no room); once the load is placed, the request reads only its
    new window, so that lock goes. It used to stay until the request's first step ended: with one
    SWA page left, the lone request could not evict the window it did not read and failed."""
    h = Harness(tiers=tiers(16, None), window=8, page=16, full_pages=6, swa_pages=3, budget=8)
    for n in (17, 35, 17):  # pages 0 and 1 with their windows on the tree
        h.add(BASES[0][:n], 1)
        h.drain()
    h.cache.evict(16, 0)  # page 1 to L2; page 0 stays in L1 with its window
    held = h.pool.swa.allocate(h.pool.swa.num_free - 1)  # one SWA page left: the one the load takes
    h.external.append(SimpleNamespace(full_pages=[], swa_pages=held))
    again = h.add(BASES[0][:35], 3)
    h.drain()
    assert again.finish_reason == "length" and again.num_cached_tokens == 32
    assert h.cache.stats()["hit_tokens_l2"] == 16
    h.cache.tiers.close()


def test_a_node_the_window_crosses_leaves_its_kept_windows_evictable():
    """The request's SWA lock is per node: the node holding the prompt's kept windows (a checkpoint,
    the prompt's last window) stayed locked whole while the request's window crossed it, and its SWA
    behind the window, which nobody read, could not be evicted: a lone request with a small SWA pool
    failed where the cache off finishes it. The node is now split where the window starts."""
    prompt = [45, 45, 38, 19, 36, 35, 14, 36, 28, 19, 22]
    h = Harness(window=8, page=1, full_pages=12, swa_pages=8, budget=23, chunk=5, interval=3, seqs=4)
    r = h.add(prompt, 1, checkpoints=(2,))
    h.drain()
    assert r.finish_reason == "length", r.error
    h.cache.clear()
    assert h.pool.all_free()


def test_a_window_computed_again_while_another_reads_it_is_folded_when_it_leaves():
    """A request that computes a window again (prompt logprobs: it takes nothing from the tree) while
    another request reads the node's copy cannot give the node its page then; it lists the page as
    its own copy, and once the reader is gone, make_room folds it before evicting. Unlisted, the
    node's copy stayed SWA-locked by the request that did not read it, and with a small SWA pool
    the lone request failed part-way."""
    first = BASES[1][:40]
    h = Harness(window=8, page=2, full_pages=64, swa_pages=8, budget=64, chunk=4, interval=1, seqs=4)
    run(h, first[:9], max_tokens=1)  # pages 0..3 and their windows on the tree
    a = h.add(first[:8] + [5], 2)  # reads the tree's SWA of those pages
    b = Request("b", first[:8] + [7], SamplingParams(max_tokens=6, prompt_logprobs=0), 99)
    h.requests.append(b)
    h.sched.add(b)
    h.drain()
    assert a.finish_reason == b.finish_reason == "length", b.error
    h.cache.clear()
    assert h.pool.all_free()
