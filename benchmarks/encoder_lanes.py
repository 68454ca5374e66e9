"""Cold long-video requests with the encoder on one lane, one lane at one thread, and two lanes, interleaved.

    .venv/bin/python benchmarks/encoder_lanes.py --quick --json /tmp/encoder_lanes.json

The pipeline benchmark's long video (16 s 720p, the benchmark checkpoint), one cold request per
variant per round, the variants' engines loaded together and taking turns (the order reversed every
other round), so a burst of load on a shared host hits every variant alike. Per variant, medians
over the rounds: TTFT, the *tail* (first token - end of the last decoded chunk: what the encoding
left when decoding ends and the last prefill step add), when decoding and encoding ended, the last
prefill step, encoder forwards and prefill steps per request, and the process CPU per request split
by thread (decode workers, encoder lane(s), engine thread, and the rest: OpenMP team workers).

Variants (``OmniEngineConfig`` fields; ratios are to one_lane):
  one_lane      --encoder-lanes 1: one encoder thread, it and the LLM at torch's intra-op setting
  split         --encoder-lanes 1 --encoder-threads 1: one encoder thread at 1 intra-op thread, the
                LLM the rest
  lanes         the default (--encoder-lanes 2): two encoder threads, the second only while a decode
                worker leaves it a CPU; the LLM and the lanes half the CPUs each
  lanes_llm_all --encoder-threads 0: the lanes beside an LLM at torch's setting (each lane at the CPUs
                the decoders leave, halved)
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from _common import base_parser, new_engine, print_table, write_json
from _pipeline_media import HD, make_video
from _bench_omni import ask, build_model, data_part, engine_config, ttft
from mm_pipeline.runtime.omni_engine import OmniEngine

VARIANTS = {"one_lane": {"encoder_lanes": 1}, "split": {"encoder_lanes": 1, "encoder_threads": 1},
            "lanes": {}, "lanes_llm_all": {"encoder_threads": 0}}
THREAD_GROUPS = ("omni-media", "omni-encoder", "omni-engine")
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> Counter:
    """CPU seconds of this process's threads so far, by group (``THREAD_GROUPS`` by Python thread
    name; every other thread, OpenMP's team workers above all, under "other")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Counter = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid), "")
        group = next((g for g in THREAD_GROUPS if name.startswith(g)), "other")
        out[group] += (int(fields[11]) + int(fields[12])) / _TICK
    return out


def one_request(engine: OmniEngine, video: bytes, question: str) -> dict[str, float]:
    timeline = engine.runtime.record_timeline()
    before, c0, t0 = thread_cpu_s(), time.process_time(), time.monotonic()
    first = asyncio.run(ttft(engine, ask(data_part("video", video), question)))
    cpu = time.process_time() - c0
    by_thread = thread_cpu_s()
    by_thread.subtract(before)
    spans = timeline.spans(t0, t0 + first)
    ends = {st: max((s.end for s in spans if s.stage == st), default=t0) - t0 for st in ("decode", "encode")}
    steps = [s for s in spans if s.stage == "prefill"]
    return {"ttft_s": first, "tail_s": first - ends["decode"], "decode_end_s": ends["decode"],
            "encode_end_s": ends["encode"], "last_step_s": steps[-1].end - steps[-1].start if steps else 0.0,
            "forwards": float(sum(s.stage == "encode" for s in spans)), "steps": float(len(steps)),
            "cpu_s": cpu, **{f"cpu_{g}_s": by_thread[g] for g in (*THREAD_GROUPS, "other")}}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="cold requests per variant (default 10, --quick 6)")
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.quick else 10)
    question = "What happens in this video?"
    videos = [make_video(16, **HD, seed=3000 + k) for k in range(rounds * len(VARIANTS))]
    load = [os.getloadavg()[0]]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    engines: dict[str, OmniEngine] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        try:
            for name, kw in VARIANTS.items():
                engines[name] = new_engine(model_dir, engine_config(**kw))
                asyncio.run(ttft(engines[name], ask(data_part("video", make_video(4, **HD, seed=99)), question)))
            k = 0
            for r in range(rounds):
                for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                    rows[name].append(one_request(engines[name], videos[k], question))
                    k += 1
        finally:
            for engine in engines.values():
                engine.shutdown()
    load.append(os.getloadavg()[0])
    keys = list(rows["one_lane"][0])
    med = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in rows.items()}
    ms = [k for k in keys if k.endswith("_s")]
    print_table(f"cold 16 s 720p requests, medians of {rounds} per variant (ms; load {load[0]:.1f} -> {load[1]:.1f})",
                ["variant", *[k[:-2] for k in ms], "forwards", "steps"],
                [(name, *[m[k] * 1000 for k in ms], m["forwards"], m["steps"]) for name, m in med.items()])
    out = {f"{name}_{k}": v for name, m in med.items() for k, v in m.items()}
    out |= {f"{name}_ttft_ratio": med[name]["ttft_s"] / med["one_lane"]["ttft_s"] for name in VARIANTS}
    out |= {f"{name}_tail_ratio": med[name]["tail_s"] / med["one_lane"]["tail_s"] for name in VARIANTS}
    write_json(args.json, {**out, "rounds": rounds, "load_start": load[0], "load_end": load[1]})


if __name__ == "__main__":
    main()
