"""The repeat and same-prefix requests' prefill steps at one intra-op thread and at all of them, alternating.

    .venv/bin/python benchmarks/repeat_step.py --quick --json /tmp/repeat_step.json

The pipeline benchmark's repeat request (``pipeline.py --repeat-only``: cached video, a new question
placed before it) is one prefill step of every media row. Whether its intra-op threads pay depends on
whether the host gives the second thread a core, which a run on a shared box cannot tell a quiet one
about. This script builds the same model, sends the same cold and repeat requests through the
engine, then runs the repeat request's step again in place (same entries, same KV slots: the step
rewrites the values it wrote) at 1 and at N threads in turn, and reports per count the median wall,
the engine thread's CPU and the process's CPU over the wall (cores used), with the load average.
Then the same for the step of a same-prefix request (``pipeline.py``'s ``same_prefix_ttft_ratio``:
the same video and question with another ending, ~30 rows after the prefix-cache hit), whose C
kernels split on the team by their work (kernels/native/team.h ``split_work_on_team``).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import base_parser, fresh_thread, new_engine, print_table, write_json
from _pipeline_media import HD, make_video
from llm_core.engine.model_runner import ModelRunner
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads
from _bench_omni import ask, build_model, data_part, engine_config, ttft


def rerun_step(threads: tuple[int, ...], pairs: int) -> dict[str, float]:
    """Run the repeat request, then a same-prefix request, through a fresh engine; during each one's
    step (on the engine thread, while the request still holds its pages) run that step again
    ``pairs`` times per thread count."""
    found: dict[str, dict] = {}
    wanted: list[str] = []
    run = ModelRunner.run

    def alternate(self, entries, kv) -> dict:
        base = torch.get_num_threads()
        times: dict[int, list[tuple[float, float, float]]] = {n: [] for n in threads}
        policy, self.before_step = self.before_step, None  # the counts below, not the engine's per-step choice
        try:
            for _ in range(pairs + 1):  # the first round warms each count up and is dropped
                for n in threads:
                    set_local_threads(n)
                    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                    run(self, entries, kv)
                    times[n].append((time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0))
        finally:
            set_local_threads(base)
            self.before_step = policy
        return {"times": times, "rows": sum(e.num_new_tokens for e in entries)}

    def measured(self, entries, kv):  # the request's one step: the only step after the one before
        out = run(self, entries, kv)
        if wanted:
            found[wanted.pop()] = alternate(self, entries, kv)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        engine = new_engine(fresh_thread(build_model, Path(tmp)), engine_config(enable_prefix_caching=True,
                                                                                   prefix_checkpoint_every=64))
        load0 = os.getloadavg()[0]
        ModelRunner.run = measured
        try:
            part = data_part("video", make_video(12, **HD, seed=200))
            asyncio.run(ttft(engine, ask(part, "Describe the video in detail.")))
            wanted.append("repeat")
            asyncio.run(ttft(engine, [{"role": "user", "content": [
                {"type": "text", "text": "Question 0: how many squares are there?"}, part]}]))
            wanted.append("same_prefix")  # diverges after "detail", as pipeline.py's first same-prefix request
            asyncio.run(ttft(engine, ask(part, "Describe the video in detail! Keep it brief.")))
        finally:
            ModelRunner.run = run
            engine.shutdown()
    if set(found) != {"repeat", "same_prefix"}:
        raise RuntimeError(f"the requests ran no model step ({sorted(found)} measured)")
    out = {"load_start": load0, "load_end": os.getloadavg()[0], "pairs": float(pairs)}
    for name, got in found.items():
        prefix = "" if name == "repeat" else "same_prefix_"
        out[f"{prefix}step_rows"] = float(got["rows"])
        for n, t in got["times"].items():
            wall, cpu, proc = (statistics.median(x[i] for x in t[1:]) for i in range(3))
            out.update({f"{prefix}threads_{n}_wall_ms": wall * 1e3, f"{prefix}threads_{n}_thread_cpu_ms": cpu * 1e3,
                        f"{prefix}threads_{n}_cores": proc / wall})
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0,
                        help="the count compared with one thread (default: torch's setting)")
    args = parser.parse_args()
    n = args.threads or torch.get_num_threads()
    if n < 1:
        parser.error("--threads must be >= 1")
    threads = (1,) if n == 1 else (1, n)
    res = rerun_step(threads, pairs=10 if args.quick else 30)
    for prefix, what in (("", "repeat request's step"), ("same_prefix_", "same-prefix request's step")):
        print_table(f"{what} ({res[prefix + 'step_rows']:.0f} rows), medians of {res['pairs']:.0f} alternating "
                    f"runs, load {res['load_start']:.2f} -> {res['load_end']:.2f}",
                    ["intra-op threads", "wall ms", "engine thread CPU ms", "cores used"],
                    [(t, res[f"{prefix}threads_{t}_wall_ms"], res[f"{prefix}threads_{t}_thread_cpu_ms"],
                      res[f"{prefix}threads_{t}_cores"]) for t in threads])
    write_json(args.json, res)


if __name__ == "__main__":
    main()
