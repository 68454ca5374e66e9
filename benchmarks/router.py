"""Routing on a cluster: the prefix/media-affinity LLM router and consistent-hash encoder routing.

Simulation (always; no engines, only the routers and a cache model per replica):

* LLM replicas: each keeps an LRU prefix cache of ``--cache-blocks`` 16-token blocks (a request hits
  the longest run of its leading blocks still cached, then caches all of them) and computes at a fixed
  rate, prefill of the missed tokens plus decode; the router sees each replica's queued + running
  tokens. Two closed-loop traces: a multi-turn agent (shared system prompt, each turn the whole
  history + a tool output + a question) and question-per-video (each video asked several questions,
  interleaved). Routers: affinity (mm_pipeline/cluster/serving/affinity_policy.py), round-robin, and Ray
  Serve's default (power of two random choices, the less loaded). Reported: prefix hit rate, prefill
  tokens computed, throughput (tokens / makespan) and balance (busiest replica's work / mean).
* Encoder replicas: each keeps an LRU encoder cache of ``--encoder-cache-units`` units; every video is
  ``--units`` units; consistent hashing with bounded loads (mm_pipeline/cluster/serving/consistent_hash.py)
  vs random choice. Reported: encoder-cache hit rate and balance.
* Scale: the agent trace at 8, 16, 32, 64 replicas (conversations grow with replicas).

``--served``: the same agent and question-per-media traces over HTTP against ``serve --ray`` on a
local Ray cluster (2 LLM replicas of samples/demo-model, one thread each), affinity vs round-robin vs
Ray Serve's default; then an LLM replica is killed once the first of 24 requests is answered (the
rest in flight) and lost requests are counted. KV under pressure, as in a real deployment: each
replica's Full KV pool is sized to a share of the live conversations' prefixes (conversations in
flight x the trace's mean prompt, estimated from its text before the run; the JSON also gives the
share measured from the served prompts): ``--served-kv-shares`` 0.5 (the headline: round-robin's
replicas each see every live conversation, only half fits; affinity's see half of them), 0.75, 1.0.

    python benchmarks/router.py [--quick] [--json out.json] [--served]
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import heapq
import os
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from _common import base_parser, print_table, write_json

from mm_pipeline.cluster.serving.affinity_policy import AffinityPolicy
from mm_pipeline.cluster.serving.consistent_hash import BoundedLoadRing
from mm_pipeline.cluster.serving.route_key import RouteKey, key_of_pieces
from mm_pipeline.cluster.serving.router_state import MemoryPrefixIndex

PAGE = 16  # the engine's KV page, tokens
DECODE_COST = 8  # a decoded token costs this many prefill tokens of replica time (memory-bound steps)


# ---- the per-replica cache model ----------------------------------------------------------------------
@dataclass
class Replica:
    cap: int
    cache: OrderedDict = field(default_factory=OrderedDict)
    free_at: float = 0.0
    work: float = 0.0

    def serve(self, key: RouteKey) -> int:
        """Cached tokens of ``key``'s prompt; caches all its blocks (LRU)."""
        hit = 0
        for h in key.hashes:
            if h not in self.cache:
                break
            hit += 1
        for h in key.hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cap:
            self.cache.popitem(last=False)
        return key.weight_of(hit)


class Router:
    def __init__(self, kind: str, n: int, seed: int) -> None:
        self.kind, self.names = kind, [f"r{i}" for i in range(n)]
        self.rng = random.Random(seed)
        self.turn = 0
        self.policy = AffinityPolicy(MemoryPrefixIndex(max_blocks_per_replica=None)) if kind == "affinity" else None

    def choose(self, key: RouteKey, loads: dict[str, float]) -> str:
        if self.kind == "affinity":
            r = self.policy.rank(key, loads)[0]
            self.policy.dispatched(r, key)
            return r
        if self.kind == "round_robin":
            self.turn += 1
            return self.names[self.turn % len(self.names)]
        a, b = self.rng.sample(self.names, 2) if len(self.names) > 1 else (self.names[0],) * 2
        return a if loads[a] <= loads[b] else b


def simulate(kind: str, n: int, sessions: list[list[RouteKey]], cap: int, decode: int, concurrency: int,
             rate: float = 1000.0, seed: int = 0) -> dict:
    """Closed loop: ``concurrency`` sessions at a time, each sends its next request when the last one
    finished. A replica's load is its queued + running tokens at the decision time."""
    router = Router(kind, n, seed)
    reps = {name: Replica(cap) for name in router.names}
    events: list[tuple[float, int, int]] = []  # (time, session, next request index)
    for s in range(min(concurrency, len(sessions))):
        heapq.heappush(events, (0.0, s, 0))
    started = min(concurrency, len(sessions))
    prompt = cached = 0
    end = 0.0
    while events:
        now, s, i = heapq.heappop(events)
        key = sessions[s][i]
        loads = {name: max(0.0, r.free_at - now) * rate for name, r in reps.items()}
        rep = reps[router.choose(key, loads)]
        hit = rep.serve(key)
        cost = (key.total - hit) + decode * DECODE_COST
        rep.free_at = max(rep.free_at, now) + cost / rate
        rep.work += cost
        prompt, cached, end = prompt + key.total, cached + hit, max(end, rep.free_at)
        if i + 1 < len(sessions[s]):
            heapq.heappush(events, (rep.free_at, s, i + 1))
        elif started < len(sessions):
            heapq.heappush(events, (rep.free_at, started, 0))
            started += 1
    works = [r.work for r in reps.values()]
    return dict(hit_rate=cached / prompt, prefill=prompt - cached, prompt=prompt,
                throughput=(prompt + decode * sum(map(len, sessions))) / end,
                balance=max(works) / (sum(works) / len(works)))


def agent_sessions(conversations: int, turns: tuple[int, int], seed: int) -> list[list[RouteKey]]:
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(750)]
    out = []
    for c in range(conversations):
        pieces: list = [("tokens", system)]
        keys = []
        for _ in range(rng.randint(*turns)):
            pieces.append(("tokens", [rng.randrange(50_000) for _ in range(rng.randint(60, 220))]))  # tool + question
            keys.append(key_of_pieces(pieces))
            pieces.append(("tokens", [rng.randrange(50_000) for _ in range(40)]))  # the reply
        out.append(keys)
    return out


def video_sessions(videos: int, questions: int, media_tokens: int, seed: int) -> list[list[RouteKey]]:
    """One request per session (questions are independent users), shuffled."""
    rng = random.Random(seed)
    system = [7] * 20
    reqs = [[key_of_pieces([("tokens", system), ("media", f"video-{v}"),
                            ("tokens", [rng.randrange(50_000) for _ in range(12)])], media_weight=media_tokens)]
            for v in range(videos) for _ in range(questions)]
    rng.shuffle(reqs)
    return reqs


def encoder_sim(kind: str, n: int, videos: int, questions: int, units: int, cap: int, burst: int, seed: int) -> dict:
    """Requests arrive ``burst`` at a time (their units in flight together); each unit goes to one
    encoder replica, which hits if it still caches the unit's key."""
    rng = random.Random(seed)
    names = [f"e{i}" for i in range(n)]
    ring = BoundedLoadRing(names)
    caches = {e: OrderedDict() for e in names}
    work = dict.fromkeys(names, 0)
    order = [v for v in range(videos) for _ in range(questions)]
    rng.shuffle(order)
    hits = total = 0
    for b in range(0, len(order), burst):
        loads = dict.fromkeys(names, 0)
        for v in order[b:b + burst]:
            for u in range(units):
                key = f"video-{v}#{u}"
                e = ring.choose(key, loads) if kind == "consistent_hash" else rng.choice(names)
                loads[e] += 1
                c = caches[e]
                if key in c:
                    hits += 1
                    c.move_to_end(key)
                else:
                    work[e] += 1
                    c[key] = None
                    if len(c) > cap:
                        c.popitem(last=False)
                total += 1
    mean = sum(work.values()) / n
    return dict(hit_rate=hits / total, balance=max(work.values()) / mean if mean else 1.0)


ROUTERS = ("affinity", "round_robin", "pow2")


def run_simulation(quick: bool, args) -> dict:
    results: dict = {}
    conv = 16 if quick else 48
    traces = {"agent": (agent_sessions(conv, (5, 12), 0), 16),
              "video": (video_sessions(12 if quick else 32, 4, 512, 1), 8)}
    rows = []
    for trace, (sessions, decode) in traces.items():
        for kind in ROUTERS:
            r = simulate(kind, 2, sessions, args.cache_blocks, decode, concurrency=4)
            rows.append((trace, kind, r["hit_rate"], r["prefill"], r["throughput"], r["balance"]))
            for k in ("hit_rate", "prefill", "throughput", "balance"):
                results[f"sim2_{trace}_{kind}_{k}"] = r[k]
    print_table("LLM routing, 2 replicas (simulated; LRU prefix cache of "
                f"{args.cache_blocks} blocks per replica)",
                ["trace", "router", "hit rate", "prefill tokens", "tokens/s", "balance"], rows)
    for trace in traces:
        results[f"sim_{trace}_hit_rate_ratio_vs_round_robin"] = (
            results[f"sim2_{trace}_affinity_hit_rate"] / results[f"sim2_{trace}_round_robin_hit_rate"])
        results[f"sim_{trace}_hit_rate_ratio_vs_pow2"] = (
            results[f"sim2_{trace}_affinity_hit_rate"] / results[f"sim2_{trace}_pow2_hit_rate"])

    rows = []  # the same 2-replica agent trace under cache pressure: what round-robin's duplicates cost
    for cap in (128, 256, 512, 2048):
        r = {kind: simulate(kind, 2, traces["agent"][0], cap, 16, concurrency=4) for kind in ROUTERS}
        ratio = r["affinity"]["hit_rate"] / r["round_robin"]["hit_rate"]
        rows.append((cap * 16, r["affinity"]["hit_rate"], r["round_robin"]["hit_rate"], r["pow2"]["hit_rate"], ratio,
                     r["affinity"]["throughput"] / r["round_robin"]["throughput"]))
        results[f"sim2_agent_cache{cap}_hit_rate_ratio_vs_round_robin"] = ratio
    print_table("2 replicas, agent trace, by prefix-cache size per replica (simulated)",
                ["cache tokens", "affinity", "round-robin", "pow2", "hit ratio vs RR", "tokens/s ratio vs RR"], rows)

    rows = []
    for n in (8, 16, 32, 64):
        sessions = agent_sessions((4 if quick else 8) * n, (5, 12) if not quick else (4, 6), n)
        for kind in ROUTERS:
            r = simulate(kind, n, sessions, args.cache_blocks, 16, concurrency=2 * n)
            rows.append((n, kind, r["hit_rate"], r["throughput"], r["balance"]))
            results[f"scale{n}_{kind}_hit_rate"], results[f"scale{n}_{kind}_balance"] = r["hit_rate"], r["balance"]
    print_table("LLM routing at scale (simulated agent trace, conversations = "
                f"{4 if quick else 8} x replicas, 2 in flight per replica)",
                ["replicas", "router", "hit rate", "tokens/s", "balance"], rows)

    rows = []
    videos, questions, units = (40, 4, 8) if quick else (120, 4, 8)
    for n in (2, 8, 32):
        cap = max(units, int(1.5 * videos * units / n))  # the working set fits the tier, not one replica
        for kind in ("consistent_hash", "random"):
            r = encoder_sim(kind, n, videos, questions, units, cap, burst=n, seed=n)
            rows.append((n, kind, cap, r["hit_rate"], r["balance"]))
            results[f"enc{n}_{kind}_hit_rate"], results[f"enc{n}_{kind}_balance"] = r["hit_rate"], r["balance"]
    print_table(f"Encoder routing (simulated; {videos} videos x {questions} questions, {units} units each; "
                "cache = 1.5 x the tier's share of the working set)",
                ["encoders", "routing", "cache units", "hit rate", "balance"], rows)
    results["encoder_hit_rate_ratio_vs_random"] = results["enc2_consistent_hash_hit_rate"] / results["enc2_random_hit_rate"]
    return results


# ---- served: serve --ray on a local cluster ------------------------------------------------------------
def kill_one_replica(ray, url: str) -> dict:
    """Kill one LLM replica once the first of 24 requests is answered (the rest in flight); count the
    requests never answered (a client retries a 503 as the ``openai`` client does)."""
    import concurrent.futures as cf
    import time

    import httpx

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA") and "#LLM#" in a["name"]]

    def one(i: int) -> bool:
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "model": "demo-model", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"request {i}: count to twenty"}]})
            if r.status_code == 200:
                return True
            if r.status_code != 503:
                return False
            time.sleep(float(r.headers.get("retry-after", 1)))
        return False

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        cf.wait(futures, timeout=120, return_when=cf.FIRST_COMPLETED)  # under load for sure
        in_flight = sum(not f.done() for f in futures)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        done, pending = cf.wait(futures, timeout=300)
    return {"requests_in_flight_at_kill": in_flight,
            "lost_requests_on_kill": len(pending) + sum(not f.result() for f in done)}


def run_served(quick: bool, kv_shares: list[float]) -> dict:
    """The agent trace at each KV share (the first is the headline), every router; the media trace and
    the kill at the first share."""
    import socket
    import time

    from _served_traces import agent_mean_prompt_tokens, agent_trace, question_per_media_trace

    from mm_pipeline.cluster.ray_runtime import RayClusterConfig, connect
    from mm_pipeline.cluster.serving.serve_app import ServeClusterConfig, start, stop
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.server.settings import ServerSettings
    from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

    os.environ["PYTHONPATH"] = _bench_bootstrap.ROOT  # the local cluster's workers import this checkout
    ray = connect(RayClusterConfig(num_cpus=2))
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    media = sorted(SAMPLE_MEDIA.glob("video_*")) + sorted(SAMPLE_MEDIA.glob("image_*"))
    # a short system prompt: the conversations' own histories, which only affinity keeps together,
    # are most of each prompt (with a long shared one every router hits on it)
    trace = dict(conversations=16 if quick else 32, turns=(5, 8) if quick else (5, 12), system_words=40, max_tokens=8)
    concurrency = 8
    live = concurrency * agent_mean_prompt_tokens(DEMO_MODEL, **trace)  # live conversations' prefixes, tokens
    results: dict = {"served_concurrent_conversations": concurrency, "served_live_prefix_tokens_estimated": live}
    print(f"served agent trace: {trace['conversations']} conversations, {concurrency} at once; live prefixes "
          f"~{live:.0f} tokens (estimated)")
    rows, media_rows, mean_prompts = [], [], []
    for n, share in enumerate(kv_shares):
        kv_tokens = max(PAGE, round(share * live / PAGE) * PAGE)  # one replica's Full KV pool
        tag = f"served_kv{round(100 * share)}"
        results[f"{tag}_pool_tokens"] = kv_tokens
        hit = {}
        for router in ROUTERS:
            cluster = ServeClusterConfig(llm_replicas=2, llm_num_cpus=0.5, torch_threads=1, router=router, port=port,
                                         routing_stats_period_s=0.2)
            start(DEMO_MODEL, OmniEngineConfig.from_kwargs(device="cpu", dtype="float32", num_full_tokens=kv_tokens),
                  ServerSettings(), cluster)
            t0 = time.perf_counter()
            agent = agent_trace(url, concurrency=concurrency, **trace)
            t_agent = time.perf_counter() - t0
            mean_prompts.append(agent["prompt_tokens"] / agent["requests"])
            hit[router] = agent["hit_rate"]
            rows.append((share, kv_tokens, router, agent["hit_rate"], agent["prompt_tokens"] - agent["cached_tokens"],
                         agent["requests"] / t_agent))
            results[f"{tag}_agent_{router}_hit_rate"] = agent["hit_rate"]
            results[f"{tag}_agent_{router}_prefill_tokens"] = agent["prompt_tokens"] - agent["cached_tokens"]
            results[f"{tag}_agent_{router}_requests_per_s"] = agent["requests"] / t_agent
            if n == 0:
                video = question_per_media_trace(url, DEMO_MODEL, media[:3] if quick else media, questions=3,
                                                 max_tokens=8)
                media_rows.append((router, video["media_hit_rate"]))
                results[f"served_video_{router}_media_hit_rate"] = video["media_hit_rate"]
                if router == "affinity":
                    results.update(kill_one_replica(ray, url))
            stop(cluster)
        results[f"{tag}_hit_rate_ratio_vs_round_robin"] = hit["affinity"] / hit["round_robin"]
        results[f"{tag}_hit_rate_ratio_vs_pow2"] = hit["affinity"] / hit["pow2"]
        if n == 0:
            results["router_hit_rate_ratio_vs_round_robin"] = hit["affinity"] / hit["round_robin"]
            results["router_hit_rate_ratio_vs_pow2"] = hit["affinity"] / hit["pow2"]
    measured = concurrency * sum(mean_prompts) / len(mean_prompts)
    results["served_live_prefix_tokens_measured"] = measured
    for share in kv_shares:
        tag = f"served_kv{round(100 * share)}"
        results[f"{tag}_share_measured"] = results[f"{tag}_pool_tokens"] / measured
    print_table("Served agent trace: serve --ray, 2 LLM replicas of the demo model (this machine); KV share = one "
                f"replica's Full KV pool / the live conversations' prefixes (measured: {measured:.0f} tokens)",
                ["KV share", "pool tokens", "router", "hit rate", "prefill tokens", "req/s"],
                [(f"{r[1] / measured:.2f}",) + r[1:] for r in rows])
    print_table(f"Served question per media (KV share {kv_shares[0]})", ["router", "media hit rate"], media_rows)
    print(f"\nLLM replica killed with {results['requests_in_flight_at_kill']} of 24 requests in flight: "
          f"{results['lost_requests_on_kill']} lost")
    results["router_media_hit_rate_ratio_vs_round_robin"] = (results["served_video_affinity_media_hit_rate"]
                                                              / results["served_video_round_robin_media_hit_rate"])
    serve.shutdown()
    ray.shutdown()
    return results


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--served", action="store_true", help="also run the traces against serve --ray (minutes)")
    p.add_argument("--served-kv-shares", default="0.5,0.75,1.0",
                   help="--served: one replica's Full KV pool as shares of the live conversations' prefixes, "
                        "comma-separated; the first is the headline")
    p.add_argument("--cache-blocks", type=int, default=2048, help="prefix-cache blocks per simulated replica")
    args = p.parse_args()
    results = run_simulation(args.quick, args)
    if args.served:
        results.update(run_served(args.quick, [float(x) for x in args.served_kv_shares.split(",")]))
    else:  # the simulated 2-replica agent trace stands in for the served one
        results["router_hit_rate_ratio_vs_round_robin"] = results["sim_agent_hit_rate_ratio_vs_round_robin"]
    results.setdefault("lost_requests_on_kill", -1)  # -1: not measured (no --served)
    print(f"\nrouter hit rate vs round-robin: {results['router_hit_rate_ratio_vs_round_robin']:.2f}x (goal >= 1.25); "
          f"encoder hit rate vs random: {results['encoder_hit_rate_ratio_vs_random']:.2f}x (goal >= 1.3)")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
