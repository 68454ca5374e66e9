"""Greedy tokens with the prefix cache on == off, on the tiny MiMo-V2 model (window 8, page 4).

Multi-turn conversations share a system prompt and each turn re-sends the whole history, so later turns
hit the cache across window boundaries. Variants: the naive reference cache, checkpoints, an L1 so small
that the tree evicts and tombstones constantly, media content keys, and the tiers (L2 host memory, L3
directory store, restart with the same directory, damaged L3 entries, Redis down).
"""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from tests.oracles.naive_prefix_cache import NaivePrefixCache
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytest.importorskip("transformers")

PAGE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


def make(model, **kw) -> LLM:
    cfg = dict(page_size=PAGE, max_chunk_tokens=7, max_num_batched_tokens=24, num_full_tokens=1024,
               num_swa_tokens=256)
    prefix_cache = kw.pop("prefix_cache", None)
    engine = LLMEngine(model, EngineConfig(**{**cfg, **kw}))
    if prefix_cache is not None:  # a cache class built over this engine's own pool
        engine.prefix_cache = engine.scheduler.prefix_cache = prefix_cache(engine.pool)
    return LLM.from_engine(engine)


def conversations(llm: LLM, n_conv: int = 3, turns: int = 3, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Every conversation: system prompt + per turn a user message; each turn re-sends the history.
    Returns the outputs of every turn and the cached-token counts."""
    system = ids(seed, 19)
    histories = [system + ids(seed + 100 + c, 5 + 3 * c) for c in range(n_conv)]
    outs, cached = [], []
    for t in range(turns):
        res = llm.generate(histories, GREEDY)
        for c, r in enumerate(res):
            outs.append(r.token_ids)
            cached.append(r.num_cached_tokens)
            histories[c] = histories[c] + r.token_ids + ids(seed + 1000 + 10 * t + c, 4 + 2 * t)
    return outs, cached


@pytest.fixture(scope="module")
def reference(model):
    return conversations(make(model))[0]


def test_cache_on_equals_off_and_hits(model, reference):
    llm = make(model, enable_prefix_caching=True)
    outs, cached = conversations(llm)
    assert outs == reference
    assert all(c > 0 for c in cached[3:]), cached  # every later turn re-uses its history
    assert all(c % PAGE == 0 for c in cached)
    llm.engine.prefix_cache.check_integrity()
    stats = llm.engine.stats()
    assert sum(stats.prefix_cache_hit_tokens.values()) == sum(cached) and stats.kv_pool["full"].used_pages > 0
    llm.engine.prefix_cache.clear()
    assert llm.engine.pool.all_free()


def test_naive_reference_cache_gives_the_same_tokens_and_hits(model, reference):
    tree_cached = conversations(make(model, enable_prefix_caching=True))[1]
    outs, cached = conversations(make(model, prefix_cache=lambda pool: NaivePrefixCache(pool)))
    assert outs == reference and cached == tree_cached


def test_checkpoints_let_the_shared_system_prompt_hit(model, reference):
    ckpt = make(model, enable_prefix_caching=True, prefix_checkpoint_every=8)
    assert conversations(ckpt)[0] == reference
    system = ids(0, 19)
    for every, expect in ((0, 0), (8, 16)):
        llm = make(model, enable_prefix_caching=True, prefix_checkpoint_every=every)
        llm.generate([system + ids(7, 9)], GREEDY)
        # shares only the 19-token system prompt: the first request's SWA survives only at its tail
        # and its prompt's end (position 24), and with checkpoints at 8 and 16 as well
        second = llm.generate([system + ids(8, 9)], GREEDY)[0]
        alone = make(model).generate([system + ids(8, 9)], GREEDY)[0]
        assert second.num_cached_tokens == expect and second.token_ids == alone.token_ids
        llm.engine.prefix_cache.check_integrity()


def test_tiny_l1_evicts_and_still_matches(model, reference):
    llm = make(model, enable_prefix_caching=True, num_full_tokens=96, num_swa_tokens=64,
               prefix_checkpoint_every=8)
    outs, _ = conversations(llm)
    assert outs == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_evicted_pages["full"] > 0 and stats.prefix_cache_evicted_pages["swa"] > 0
    llm.engine.prefix_cache.check_integrity()
    llm.engine.prefix_cache.clear()
    assert llm.engine.pool.all_free()


def test_fewest_uncached_queue_order_gives_the_same_tokens(model, reference):
    outs, _ = conversations(make(model, enable_prefix_caching=True, queue_policy="fewest_uncached"))
    assert outs == reference


def test_equal_ids_with_different_media_keys_do_not_share(model):
    llm = make(model, enable_prefix_caching=True, prefix_checkpoint_every=8)
    prompt = ids(5, 30)
    eng = llm.engine
    for rid, key in (("a", b"img-1"), ("b", b"img-1"), ("c", b"img-2")):
        eng.add_request(rid, prompt, GREEDY, extra_keys=((8, 16, key),))
        done = {}
        while not done:
            done = {o.request_id: o for o in eng.step() if o.finished}
        cached = done[rid].num_cached_tokens
        if rid == "b":
            assert cached == 28  # same media: everything but the last page's token
        if rid == "c":
            assert cached == 8  # other media from position 8 on: only the text before it (a checkpoint)


def tier_engine(model, **kw) -> LLM:
    row = 2 * PAGE * (2 * 4 * (24 + 16) + 4 * 8 * (24 + 16)) * 4  # Full + SWA rows of one page, with room
    cfg = dict(enable_prefix_caching=True, num_full_tokens=96, num_swa_tokens=64, prefix_checkpoint_every=8,
               kv_host_bytes=40 * row)
    return make(model, **{**cfg, **kw})


def test_l2_and_l3_hits_give_the_same_tokens(model, reference, tmp_path):
    # L2 alone: its loads are awaited inside the step, so the schedule (and which tier hits) is
    # deterministic and L2 must serve pages L1 evicted
    only_l2 = tier_engine(model)
    assert conversations(only_l2)[0] == reference
    stats = only_l2.engine.stats()
    assert stats.prefix_cache_hit_tokens.get("l2", 0) > 0 and stats.prefix_cache["pages_saved"] > 0
    only_l2.engine.close()
    # L2 + L3: L3 reads run on fetch threads while other requests step (RequestStatus.LOADING), so
    # the order requests are scheduled in -- and hence which tier a page is found in -- follows
    # thread timing; the tokens must not, and pages must come from below L1. A read that outlives
    # kv_l3_load_timeout_s is given up (a miss, by design), so on a busy machine the default 1 s
    # could turn every lower-tier hit into a miss: the generous timeout only bounds that wait. Under
    # load a schedule can also keep every needed page in L1 (all hits "l1"): the tokens are checked
    # every time, and up to three fresh stores get the chance to show a hit from below L1
    seen = []
    for attempt in range(3):
        llm = tier_engine(model, kv_store=str(tmp_path / f"l3-{attempt}"), kv_l3_load_timeout_s=30.0)
        outs, _ = conversations(llm)
        assert outs == reference
        hits = dict(llm.engine.stats().prefix_cache_hit_tokens)
        llm.engine.close()
        seen.append(hits)
        if hits.get("l2", 0) + hits.get("l3", 0) > 0:
            break
    assert hits.get("l2", 0) + hits.get("l3", 0) > 0, seen
    only_l3 = tier_engine(model, kv_host_bytes=0, kv_store=str(tmp_path / "l3b"), kv_l3_load_timeout_s=30.0)
    assert conversations(only_l3)[0] == reference
    assert only_l3.engine.stats().prefix_cache["l3_puts"] > 0  # written behind, on the writer thread
    only_l3.engine.close()  # waits for the pending L3 writes
    # a fresh engine (empty L1, no L2) over the same store finds the pages in L3 from its first turn;
    # the generous read timeout only bounds the wait for local-directory reads on a busy machine
    again = tier_engine(model, kv_host_bytes=0, kv_store=str(tmp_path / "l3b"), kv_l3_load_timeout_s=30.0)
    assert conversations(again)[0] == reference
    assert again.engine.stats().prefix_cache_hit_tokens.get("l3", 0) > 0
    again.engine.close()


def test_restart_with_the_same_directory_and_damaged_entries(model, reference, tmp_path):
    store = str(tmp_path / "l3")
    first = tier_engine(model, kv_store=store, kv_host_bytes=0, num_full_tokens=1024, num_swa_tokens=256)
    conversations(first)
    first.engine.close()  # the tree is written down
    second = tier_engine(model, kv_store=store, kv_host_bytes=0)
    outs, cached = conversations(second)
    assert outs == reference and cached[0] > 0  # even the very first request hits after the restart
    assert second.engine.stats().prefix_cache_hit_tokens["l3"] > 0
    second.engine.close()
    for i, f in enumerate(sorted((tmp_path / "l3").glob("??/*.entry"))):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if i % 2 else data[:-9] + bytes(b ^ 0x5A for b in data[-9:]))
    third = tier_engine(model, kv_store=store, kv_host_bytes=0)
    assert conversations(third)[0] == reference  # (its later L3 hits are entries it wrote itself)
    assert third.engine.prefix_cache.tiers.store.stats["corrupt"] > 0
    third.engine.close()


def test_redis_unreachable_is_a_miss(model, reference):
    llm = tier_engine(model, kv_host_bytes=0, kv_store="redis://127.0.0.1:1/0")
    assert conversations(llm)[0] == reference
    llm.engine.close()


def test_other_weights_never_share_l3_entries(tmp_path, reference, model):
    other = load_model(build_tiny_hf_checkpoint(tmp_path / "other", seed=1), dtype=torch.float32)
    store = str(tmp_path / "l3")
    first = tier_engine(model, kv_store=store, kv_host_bytes=0)
    conversations(first)
    first.engine.close()
    llm = tier_engine(other, kv_store=store, kv_host_bytes=0)
    # conversation 0's first turn is in the store (with the same weights it hits: the restart test)
    assert llm.generate([ids(0, 19) + ids(100, 5)], GREEDY)[0].num_cached_tokens == 0
    assert llm.engine.stats().prefix_cache_hit_tokens.get("l3", 0) == 0
    assert conversations(llm)[0] == conversations(make(other))[0]
    llm.engine.close()


def test_window_advance_skip_changes_nothing(model, reference, monkeypatch):
    """SWARadixCache._advance_window skips a call whose tail, window and path are those of the last
    advance. Forced to advance every time instead, the same conversations (tiny L1: evictions,
    tombstones and splits) give the same tokens, hits, trimmed pages and free pages."""
    from llm_core.kvcache import swa_radix_cache

    skips = []

    def run(skip: bool):
        real = swa_radix_cache.SWARadixCache._advance_window

        def wrapped(self, holder):
            if skip:  # count the calls the check skips
                skips.append(holder.advanced == (holder.tail, holder.tail.end, holder.swa_lo, self.tree.splits))
            else:
                holder.advanced = None
            return real(self, holder)

        monkeypatch.setattr(swa_radix_cache.SWARadixCache, "_advance_window", wrapped)
        llm = make(model, enable_prefix_caching=True, num_full_tokens=96, num_swa_tokens=64,
                   prefix_checkpoint_every=8)
        outs, cached = conversations(llm, turns=4)
        cache = llm.engine.prefix_cache
        cache.check_integrity()
        monkeypatch.undo()
        return outs, cached, dict(cache.counters), llm.engine.pool.full.num_free, llm.engine.pool.swa.num_free

    skipped, always_ = run(True), run(False)
    assert any(skips) and not all(skips)  # both kinds of call happened
    assert skipped[0][:9] == reference
    assert skipped == always_
