"""Intra-op threads: why a second one loses inside the engine, and the measured default vs torch's.

    .venv/bin/python benchmarks/intra_op_threads.py --quick --json /tmp/intra_op_threads.json

Two tables.

1. OpenMP teams (the cause; runtime/cpu_threads/thread_choice.py): 80 parallel ops (20 x a 376x256 by 256x1024
   GEMM, silu, add, mul) on one thread at 1 and 2 intra-op threads, alone and while another thread
   of the process holds an idle team of 2 (libgomp then parks idle team threads instead of spinning:
   every op pays a wake-up), and while another thread has run at 1 thread (no team); and the CPU the
   process burns in the 50 ms after the 2-thread ops end (the idle team spinning: a core taken from
   whatever runs next). Configurations take turns; each row runs in a fresh process per OpenMP
   setting (read once, when the runtime loads): mmserve's (``GOMP_SPINCOUNT`` 20,000,
   mm_pipeline/openmp_env.py), libgomp's default spin (300,000), ``OMP_WAIT_POLICY`` PASSIVE and
   ACTIVE. Medians and maxima in ms.
2. Engines side by side in one process, taking turns: "torch" (``--llm-threads none
   --encoder-threads none``: both threads at torch's setting, the default before) and "auto" (each
   thread measures its count at start, the default): a cold 16 s 720p video's TTFT and the process
   CPU it took, a cold 12 s video and its repeat request (new question before the video; prefix
   caching on), and text-only decode (B requests x 32 greedy tokens: decode tokens/s). Medians of
   the rounds, with minima.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from _common import base_parser, new_engine, print_table, write_json
from _pipeline_media import HD, make_video
from llm_core import SamplingParams
from _bench_omni import ask, build_model, data_part, engine_config, ttft
from mm_pipeline.runtime.omni_engine import OmniEngine

# the OpenMP settings of table 1's rows: the child's environment on top of this one's (without either
# variable; the child's mm_pipeline import then sets mmserve's spin count unless the row sets its own)
SETTINGS = {"mmserve": {}, "libgomp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
TEAM_CONFIGS = ("1 thread", "2 threads, one team", "2 threads + idle team", "2 threads + 1-thread neighbour")
IDLE = "CPU in 50 ms after"  # table 1's last column: the process's CPU while its threads idle
VARIANTS = {"torch": dict(llm_threads=None, encoder_threads=None), "auto": {}}


def teams_child(rounds: int) -> dict[str, list[float]]:
    """Table 1's configurations in this process (run as a child: ``--teams-child``)."""
    g = torch.Generator().manual_seed(0)
    a, w, x = torch.randn(376, 256, generator=g), torch.randn(256, 1024, generator=g), torch.randn(376, 1024, generator=g)

    def work() -> None:
        for _ in range(20):
            z = torch.nn.functional.silu(x)
            z.add_(a @ w)
            z.mul_(0.5)

    def neighbour(n: int, done: threading.Event) -> None:
        torch.set_num_threads(n)
        torch.randn(1000, 1000).add_(1)  # one parallel op: at n > 1 this thread's team starts and stays
        done.wait()

    times: dict[str, list[float]] = {c: [] for c in (*TEAM_CONFIGS, IDLE)}
    for _ in range(rounds):
        for config in TEAM_CONFIGS:
            done, others = threading.Event(), []
            if "+" in config:
                others = [threading.Thread(target=neighbour, args=(2 if "team" in config else 1, done))]
                others[0].start()
                time.sleep(0.05)
            torch.set_num_threads(1 if config == "1 thread" else 2)
            work()
            for _ in range(5):
                t0 = time.perf_counter()
                work()
                times[config].append((time.perf_counter() - t0) * 1e3)
            done.set()
            for t in others:
                t.join()
            if config == "2 threads, one team":  # the team idles now: what does it still burn?
                for _ in range(3):
                    work()
                    c0 = time.process_time()
                    time.sleep(0.05)
                    times[IDLE].append((time.process_time() - c0) * 1e3)
    return times


def bench_teams(rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for policy, setting in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(setting)
        done = subprocess.run([sys.executable, __file__, "--teams-child", str(rounds)], env=env, check=True,
                              capture_output=True, text=True)
        times = json.loads(done.stdout.strip().splitlines()[-1])
        for config, ts in times.items():
            key = f"teams_{policy}_{config.replace(' ', '_').replace(',', '').replace('+', 'with')}"
            out[key + "_ms"], out[key + "_max_ms"] = statistics.median(ts), max(ts)
    return out


def bench_engines(rounds: int, batch: int) -> dict[str, float]:
    question = "What happens in this video?"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got: dict[str, dict[str, list[float]]] = {n: {"long": [], "long_cpu": [], "cold": [], "repeat": [], "decode": []}
                                              for n in VARIANTS}
    out: dict[str, float] = {}

    async def decode_rate(engine: OmniEngine, r: int) -> float:
        firsts: list[float] = []
        ends: list[float] = []

        async def one(i: int) -> None:
            first = None
            async for d in engine.generate([{"role": "user", "content": f"Round {r}, story {i} about squares."}], params):
                if first is None and d.new_token_ids:
                    first = time.perf_counter()
            firsts.append(first or time.perf_counter())
            ends.append(time.perf_counter())

        await asyncio.gather(*(one(i) for i in range(batch)))
        return batch * (params.max_tokens - 1) / (max(ends) - max(firsts))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        long_e = {n: new_engine(model_dir, engine_config(**kw)) for n, kw in VARIANTS.items()}
        rep_e = {n: new_engine(model_dir, engine_config(enable_prefix_caching=True,
                                                                         prefix_checkpoint_every=64, **kw))
                 for n, kw in VARIANTS.items()}
        try:
            warm = data_part("video", make_video(4, **HD, seed=99))
            for n in VARIANTS:
                for e in (long_e[n], rep_e[n]):
                    asyncio.run(ttft(e, ask(warm, question)))
                asyncio.run(decode_rate(long_e[n], -1))
                for thread, count in long_e[n].stats().intra_op_threads.items():
                    out[f"{n}_{thread}_threads"] = float(count)
            for r in range(rounds):
                order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                for k, n in enumerate(order):
                    video = make_video(16, **HD, seed=1000 + 10 * r + k)
                    c0 = time.process_time()
                    got[n]["long"].append(asyncio.run(ttft(long_e[n], ask(data_part("video", video), question))))
                    got[n]["long_cpu"].append(time.process_time() - c0)
                for k, n in enumerate(order):
                    part = data_part("video", make_video(12, **HD, seed=2000 + 10 * r + k))
                    got[n]["cold"].append(asyncio.run(ttft(rep_e[n], ask(part, "Describe the video in detail."))))
                    got[n]["repeat"].append(asyncio.run(ttft(rep_e[n], [{"role": "user", "content": [
                        {"type": "text", "text": f"Question {r}: how many squares are there?"}, part]}])))
                for n in order:
                    got[n]["decode"].append(asyncio.run(decode_rate(long_e[n], r)))
        finally:
            for e in [*long_e.values(), *rep_e.values()]:
                e.shutdown()
    for n, d in got.items():
        for key, values in d.items():
            out[f"{n}_{key}"] = statistics.median(values)
            out[f"{n}_{key}_min"] = min(values)
        out[f"{n}_repeat_ratio"] = statistics.median([a / b for a, b in zip(d["repeat"], d["cold"])])
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--teams-child":
        print(json.dumps(teams_child(int(sys.argv[2]))))
        return
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=0, help="engine rounds (default: 4, --quick 3)")
    parser.add_argument("--batch", type=int, default=32, help="text requests decoding together")
    parser.add_argument("--skip-teams", action="store_true", help="only the engines' table")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 4)
    if rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be >= 1")
    load0 = os.getloadavg()[0]
    res: dict[str, float] = {} if args.skip_teams else bench_teams(2 if args.quick else 4)
    res.update(bench_engines(rounds, args.batch))
    res.update(load_start=load0, load_end=os.getloadavg()[0], rounds=float(rounds))
    if not args.skip_teams:
        print_table(f"80 parallel ops, ms (median / max), one process per OpenMP setting, load {load0:.2f}",
                    ["OpenMP setting", *TEAM_CONFIGS, IDLE],
                    [(p, *(f"{res[k + '_ms']:.1f} / {res[k + '_max_ms']:.0f}" for k in
                           (f"teams_{p}_{c.replace(' ', '_').replace(',', '').replace('+', 'with')}"
                            for c in (*TEAM_CONFIGS, IDLE)))) for p in SETTINGS])
    print_table(f"engines side by side, {rounds} rounds taking turns, medians (min), load {load0:.2f} -> "
                f"{res['load_end']:.2f}",
                ["variant", "threads engine/encoder", "long-video TTFT s", "its process CPU s", "repeat ms",
                 "repeat ratio", f"decode tok/s (B={args.batch})"],
                [(n, f"{res.get(f'{n}_engine_threads', 0):.0f}/{res.get(f'{n}_encoder_threads', 0):.0f}",
                  f"{res[f'{n}_long']:.3f} ({res[f'{n}_long_min']:.3f})", f"{res[f'{n}_long_cpu']:.3f}",
                  f"{res[f'{n}_repeat'] * 1e3:.1f} ({res[f'{n}_repeat_min'] * 1e3:.1f})", f"{res[f'{n}_repeat_ratio']:.3f}",
                  f"{res[f'{n}_decode']:.0f}") for n in VARIANTS])
    write_json(args.json, res)


if __name__ == "__main__":
    main()
