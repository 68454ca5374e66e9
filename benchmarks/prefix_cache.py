"""Prefix-cache hit rate on a multi-turn agent trace at a fixed KV byte budget, and the tree's cost on
random (never repeating) inputs.

Trace: one shared system prompt (a few thousand tokens); conversations of 5-20 turns, each turn appends
a tool output and a question to the whole history and generates a reply; ``--concurrency``
conversations run at once, each waiting a few engine steps ("tool time") between turns.

Hit-rate replay (model-free bookkeeping with the real Scheduler, SWARadixCache, DualKVPool and tiers;
the forward pass is skipped, sampled tokens are a fixed function of the conversation):

    (a) full layout   every layer's KV for every token (what a cache unaware of SWA keeps):
                      one pool at all 48 layers' bytes per token, tree without windows
    (b) swa tree      our tree over the dual pool (Full pool + SWA pool), no checkpoints
    (c) checkpoints   (b) + an SWA window kept every --checkpoint tokens
    (d) tiered        (c) + L2 host memory (--host-budget-gib) + L3 local directory

KV geometry = MiMo-V2.5 (9 full layers x 4 KV heads, 39 sliding x 8, head dims 192/128, window 128,
bf16); the same --budget-gib of device KV for every variant. (a)-(c) keep pools on the ``meta`` device
(bookkeeping only); (d) moves real bytes through L2/L3, so it runs a scaled copy of the geometry
(head dims 1/1: per-token byte ratios and thus every pool and host size in pages are unchanged).

hit rate = 1 - prompt tokens computed / prompt tokens submitted (recomputation after preemption counts).

Overhead: real forwards of a small random model on random prompts, prefix cache off vs on (same
pools; the tree keeps inserting and evicting and never hits). Runs alternate; the fastest of each counts.

``--served``: instead, start ``mmserve serve --model samples/demo-model`` with default flags (plus any
``--server-arg``) on 127.0.0.1 and replay an agent trace and a question-per-media trace over HTTP
(``_served_traces.py``); reports the hit rates a client sees, the server's pool split and its RSS.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import random
import tempfile
import time
import zlib
from dataclasses import dataclass

import httpx
import torch
from _common import base_parser, print_table, write_json
from prometheus_client.parser import text_string_to_metric_families

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.kvcache.dual_pool import DualKVPool, KVHeadSpec, KVLayout
from llm_core.kvcache.tiers.host_kv_pool import HostKVPool, row_elements
from llm_core.kvcache.tiers.kv_tiers import KVTiers
from llm_core.model.loader import load_model
from llm_core.engine.request import Request
from llm_core.engine.scheduler import Scheduler, SchedulerConfig
from llm_core.storage import LocalDirStore
from llm_core.kvcache.swa_radix_cache import SWARadixCache
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

GA = {0, 5, 11, 17, 23, 29, 35, 41, 47}
KINDS = tuple("full" if i in GA else "sliding" for i in range(48))
WINDOW, PAGE, BF16 = 128, 16, 2
MIMO = KVLayout(KINDS, KVHeadSpec(4, 192, 128), KVHeadSpec(8, 192, 128), WINDOW)
SCALED = KVLayout(KINDS, KVHeadSpec(4, 1, 1), KVHeadSpec(8, 1, 1), WINDOW)  # same ratios, 160x fewer bytes
ALL_LAYER_ELEMS = len(MIMO.full_layers) * MIMO.full.elements_per_token() + \
    len(MIMO.swa_layers) * MIMO.sliding.elements_per_token()
FULL_LAYOUT = KVLayout(("full",), KVHeadSpec(1, ALL_LAYER_ELEMS // 2, ALL_LAYER_ELEMS // 2),
                       KVHeadSpec(1, 1, 1), None)
GIB = 1 << 30


@dataclass(frozen=True)
class Turn:
    new_tokens: list[int]  # tool output + question appended to the history
    output_len: int


def build_trace(n_conv: int, system_len: int, turns: tuple[int, int], seed: int = 0) -> tuple[list[int], list]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 150_000) for _ in range(n)]  # noqa: E731
    system = tok(system_len)
    convs = [[Turn(tok(rng.randint(80, 300)) + tok(rng.randint(10, 40)), rng.randint(20, 80))
              for _ in range(rng.randint(*turns))] for _ in range(n_conv)]
    return system, convs


def make_cache(variant: str, budget: int, args, tmp: str):
    """(pool, cache, window) for a variant at ``budget`` bytes of device KV."""
    ps = PAGE
    if variant == "full_layout":
        tokens = budget // (ALL_LAYER_ELEMS * BF16) // ps * ps
        pool = DualKVPool(FULL_LAYOUT, num_full_tokens=tokens, num_swa_tokens=0, page_size=ps, device="meta")
        return pool, SWARadixCache(pool), None
    swa_tokens = args.swa_tokens
    full_tokens = (budget - swa_tokens * MIMO.swa_bytes_per_token(torch.bfloat16)) // \
        MIMO.full_bytes_per_token(torch.bfloat16) // ps * ps
    tiered = variant == "tiered"
    layout, device = (SCALED, "cpu") if tiered else (MIMO, "meta")
    pool = DualKVPool(layout, num_full_tokens=full_tokens, num_swa_tokens=swa_tokens, page_size=ps, device=device)
    tiers = None
    if tiered:
        real_row = (row_elements(MIMO, "full", ps) + row_elements(MIMO, "sliding", ps)) * BF16
        scaled_row = (row_elements(SCALED, "full", ps) + row_elements(SCALED, "sliding", ps)) * 4
        host_bytes = int(args.host_budget_gib * GIB) * scaled_row // real_row
        host = HostKVPool(SCALED, ps, torch.float32, host_bytes, swa_fraction=args.host_swa_fraction)
        tiers = KVTiers(pool, host=host, store=LocalDirStore(tmp), model_id="bench")
    ckpt = args.checkpoint if variant in ("checkpoints", "tiered") else 0
    return pool, SWARadixCache(pool, checkpoint_every=ckpt, tiers=tiers), WINDOW


def replay(variant: str, system: list[int], convs: list, args, tmp: str) -> dict:
    pool, cache, window = make_cache(variant, int(args.budget_gib * GIB), args, tmp)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=args.step_tokens, max_num_seqs=args.concurrency,
                                      max_chunk_tokens=args.chunk, swa_release_interval=16), pool, window, cache)
    rng = random.Random(1)
    history: dict[int, list[int]] = {}
    next_turn: dict[int, int] = {}
    wake: dict[int, int] = {}
    pending, active, seq = list(range(len(convs))), {}, 0
    submitted = computed = steps = 0
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < args.concurrency:
            c = pending.pop(0)
            history[c], next_turn[c], wake[c] = list(system), 0, steps
            active[c] = None
        for c in list(active):
            if active[c] is None and wake[c] <= steps:
                turn = convs[c][next_turn[c]]
                history[c] += turn.new_tokens
                r = Request(f"c{c}t{next_turn[c]}", history[c], SamplingParams(max_tokens=turn.output_len,
                            ignore_eos=True), seq)
                seq += 1
                submitted += r.num_prompt_tokens
                sched.add(r)
                active[c] = r
        batch = sched.schedule()
        if variant == "tiered":  # what the model does: wait for each layer's loads
            kv = cache.kv_buffers(pool)
            for i in range(len(KINDS)):
                kv.layer(i)
        for e in batch.entries:
            computed += max(0, min(e.end, e.request.num_prompt_tokens) - e.start)
        sched.after_step(batch)
        for e in batch.entries:
            r = e.request
            if e.samples and not r.finished:
                r.append_token(3 + zlib.crc32(f"{r.request_id}:{r.num_tokens}".encode()) % 150_000, None, None)
                if r.check_stop(max_model_len=1 << 30):
                    sched.finish(r, "length")
        steps += 1
        for c, r in list(active.items()):
            if r is not None and r.finished:
                if r.finish_reason != "length":
                    raise RuntimeError(f"{r.request_id} failed: {r.error}")
                history[c] = list(r.token_ids)
                next_turn[c] += 1
                wake[c] = steps + rng.randint(0, args.tool_steps)
                active[c] = None
                if next_turn[c] == len(convs[c]):
                    del active[c]
    stats = cache.stats()
    if cache.tiers is not None:
        cache.tiers.close()
    return dict(hit_rate=1 - computed / submitted, prefill_computed=computed, submitted=submitted, steps=steps,
                preemptions=sched.num_preemptions, seconds=time.perf_counter() - t0,
                l1_pages=pool.full.num_pages, hits_l2=stats.get("hit_tokens_l2", 0),
                hits_l3=stats.get("hit_tokens_l3", 0))


def overhead(args) -> tuple[float, float, float]:
    """(seconds off, seconds on, on/off - 1) on random prompts with real forwards."""
    model_cfg = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32, v_head_dim=32,
                     sliding_window=64, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=2,
                     max_position_embeddings=4096, initializer_range=0.02)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        model = load_model(build_tiny_hf_checkpoint(f"{d}/m", **model_cfg), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    n_req = 24 if args.quick else 48
    prompts = torch.randint(3, 8192, (n_req, args.overhead_prompt), generator=g).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # the Full pool holds ~2 rounds of requests: the tree fills up and must evict as it goes
    cfg = dict(page_size=16, num_full_tokens=16 * (args.overhead_prompt + 32) * 2, num_swa_tokens=16 * 256,
               max_num_seqs=16, max_num_batched_tokens=1024)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(args.repeats):
        for on in (False, True):
            eng = LLMEngine(model, EngineConfig(**cfg, enable_prefix_caching=on))
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            while eng.has_unfinished():
                eng.step()
            best[on] = min(best[on], time.perf_counter() - t0)
            if on:
                assert sum(eng.stats().prefix_cache_hit_tokens.values()) == 0
    return best[False], best[True], best[True] / best[False] - 1


def served(args) -> None:
    """Replay the traces through a default-flag ``mmserve serve`` child process (bounded by its timeouts)."""
    from _served_traces import agent_trace, question_per_media_trace

    from mm_pipeline.cli import REPO_DEMO_MODEL
    from mm_pipeline.server.launch.server_process import ServerProcess

    media_dir = REPO_DEMO_MODEL.parent / "media"
    media = sorted(p for p in media_dir.iterdir() if p.suffix != ".jsonl")
    conv, turns, questions = (4, (4, 8), 3) if args.quick else (12, (5, 12), 4)
    with ServerProcess(["--model", str(REPO_DEMO_MODEL), "--device", "cpu", *args.server_arg]) as server:
        rss_start = server.rss_bytes()
        t0 = time.perf_counter()
        agent = agent_trace(server.base_url, conversations=conv, turns=turns, system_words=args.system_words,
                            concurrency=4, max_tokens=12)
        per_media = question_per_media_trace(server.base_url, REPO_DEMO_MODEL, media, questions=questions,
                                             max_tokens=12)
        seconds = time.perf_counter() - t0
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
        rss_end = server.rss_bytes()
        startup = [ln for ln in server.output.splitlines() if ln.startswith(("KV pools", "context"))]
    pool = {}
    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name in ("mmserve_kv_pool_total_tokens", "mmserve_kv_pool_total_bytes"):
                pool[f"{smp.name.removeprefix('mmserve_kv_pool_')}_{smp.labels['pool']}"] = int(smp.value)
    print("\n".join(startup))
    print_table(f"mmserve serve {' '.join(args.server_arg) or '(default flags)'}: hit rates over HTTP",
                ["trace", "requests", "prompt / media tokens", "cached", "hit rate"],
                [("agent", agent["requests"], agent["prompt_tokens"], agent["cached_tokens"], agent["hit_rate"]),
                 ("question per media (follow-ups)", per_media["requests"], per_media["media_tokens"],
                  per_media["cached_media_tokens"], per_media["media_hit_rate"])])
    print_table("server", ["SWA bytes", "Full bytes", "SWA / Full", "RSS start MiB", "RSS end MiB", "s"],
                [(pool["total_bytes_swa"], pool["total_bytes_full"], pool["total_bytes_swa"] / pool["total_bytes_full"],
                  rss_start / 2**20, rss_end / 2**20, seconds)])
    write_json(args.json, dict(agent_hit_rate=round(agent["hit_rate"], 4),
                               media_hit_rate=round(per_media["media_hit_rate"], 4),
                               server_args=" ".join(args.server_arg),
                               rss_start_bytes=rss_start, rss_end_bytes=rss_end, seconds=round(seconds, 1),
                               **{f"agent_{k}": v for k, v in agent.items() if k != "hit_rate"},
                               **{f"media_{k}": v for k, v in per_media.items() if k != "media_hit_rate"}, **pool))


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--budget-gib", type=float, default=None, help="device KV bytes (default: by --quick)")
    p.add_argument("--host-budget-gib", type=float, default=None, help="L2 host bytes for (d)")
    p.add_argument("--host-swa-fraction", type=float, default=0.6)
    p.add_argument("--swa-tokens", type=int, default=None, help="SWA pool tokens of (b)-(d)")
    p.add_argument("--swa-cache-tokens", type=int, default=1024, help="SWA pool share for cached windows")
    p.add_argument("--checkpoint", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tool-steps", type=int, default=40, help="max engine steps a conversation waits per turn")
    p.add_argument("--overhead-prompt", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--served", action="store_true", help="replay traces through mmserve serve over HTTP")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="with --served: an extra mmserve serve argument, e.g. "
                        "--server-arg=--prefix-checkpoint-every=64")
    p.add_argument("--system-words", type=int, default=220, help="with --served: agent system prompt length")
    args = p.parse_args()
    if args.served:
        served(args)
        return
    quick = args.quick
    n_conv, system_len, turns = (24, 2560, (6, 16)) if quick else (64, 3000, (5, 20))
    args.concurrency = args.concurrency or (8 if quick else 16)
    args.budget_gib = args.budget_gib or (1.75 if quick else 3.0)
    args.host_budget_gib = args.host_budget_gib or 4 * args.budget_gib
    # one step's new tokens + a window (and page rounding) per running request + room for cached windows
    args.swa_tokens = args.swa_tokens or (args.step_tokens + args.concurrency * (WINDOW + 2 * PAGE)
                                          + args.swa_cache_tokens)
    system, convs = build_trace(n_conv, system_len, turns)
    rows, res = [], {}
    for variant, key in (("full_layout", "hit_rate_full_layout"), ("swa_tree", "hit_rate_swa_tree"),
                         ("checkpoints", "hit_rate_checkpoints"), ("tiered", "hit_rate_tiered")):
        with tempfile.TemporaryDirectory() as tmp:
            r = replay(variant, system, convs, args, tmp)
        res[key] = round(r["hit_rate"], 4)
        res[f"prefill_computed_{variant}"] = r["prefill_computed"]
        rows.append((variant, r["hit_rate"], r["prefill_computed"], r["submitted"], r["preemptions"],
                     r["hits_l2"], r["hits_l3"], r["seconds"]))
    print_table(f"hit rate at {args.budget_gib} GiB of device KV ({n_conv} conversations, "
                f"{args.concurrency} at once, system prompt {system_len})",
                ["variant", "hit rate", "prefill computed", "prompt tokens", "preempt", "L2 hits", "L3 hits", "s"],
                rows)
    off, on, ovh = overhead(args)
    res.update(random_input_overhead=round(ovh, 4), random_seconds_cache_off=round(off, 3),
               random_seconds_cache_on=round(on, 3), budget_gib=args.budget_gib, host_budget_gib=args.host_budget_gib)
    print_table("random non-repeating inputs, real forwards (fastest of --repeats)",
                ["cache off s", "cache on s", "overhead"], [(off, on, ovh)])
    write_json(args.json, res)


if __name__ == "__main__":
    main()
