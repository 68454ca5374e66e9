"""Where a same-prefix request's time goes: the same video and the same prompt prefix with another
ending (encoder cache + prefix cache hit; only the ~30 rows after the media's last page are
prefilled), part by part, medians over many requests (issue 16's ``same_prefix_ttft_ratio``).

    .venv/bin/python benchmarks/same_prefix.py --requests 60 --json /tmp/same_prefix.json

Same model, engine settings and clip as ``pipeline.py --repeat-only --quick`` (a cold request, then
a new question, then the same-prefix requests, each with an ending of its own). Each part is timed
by wrapping the runtime's method that does it: start and end in ms after the request's clock
started (wall) and the thread CPU it used; the step's time covers the LLM step until its outputs are
built (its stats snapshot included). Parts a version does not have are left out. The last two
columns are the first same-prefix request's (end, thread CPU): the one ``pipeline.py`` times, which
resumes at the media's end (~30 rows) where the later ones resume at the previous one's last page
(~16 rows).

The second table asks why the first same-prefix request's step costs more than the later ones':
after the timed requests, one more same-prefix request's step is run again in place (same entries,
same KV slots: it rewrites the values it wrote), alternating conditions before each run: none (the
previous run just ended), a busy-wait on the engine thread of 1 ms and of 50 ms (Python: no memory
touched, only time passes), 50 ms then every weight and KV page read (the data a step reads put back
in the caches), 256 MB written (every cache level evicted), and 1 ms of small matmuls (torch kept
busy: its dispatcher and the engine thread's native code paths stay in use). Each decoder layer's
forward is timed in these runs too: where in the step a condition's extra time goes.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from _common import base_parser, new_engine, print_table, write_json
from _pipeline_media import HD, make_video
from llm_core.engine.model_runner import ModelRunner
from _bench_omni import ask, build_model, data_part, engine_config, ttft
from mm_pipeline.runtime.omni_engine import OmniEngine

# (owner attribute path, method, label): the request path in the order it runs
PARTS = (("runtime", "prepare_chat", "prepare_chat (event loop: hops included)"),
         ("runtime.preparation", "_one_hop", "  one hop: ingest + plan + layout (worker)"),
         ("runtime.ingestor", "ingest_local", "  ingest (data-URL id, memo hit)"),
         ("runtime.planner", "_plan_sync", "  plan (worker, usual path)"),
         ("runtime.producer_lookup", "lookup", "  encoder-cache lookups"),
         ("runtime.model.layout", "render", "  layout: template, BPE, placeholders"),
         ("runtime", "open_media", "open_media + cached rows"),
         ("runtime", "submit", "submit to the engine thread"),
         ("runtime.llm", "step", "LLM step (engine thread)"),
         ("runtime.llm.scheduler", "schedule", "  schedule (prefix match, pages)"),
         ("runtime.llm.runner", "_sampling_hidden", "  forward (input preparation + layers)"),
         ("runtime.llm.runner.decode_state", "build", "    input preparation"))


def _owner(engine: OmniEngine, path: str):
    if path == "runtime.producer_lookup":
        return engine.runtime.planner.producer
    obj = engine
    for name in path.split("."):
        obj = getattr(obj, name, None)  # None: a part this engine does not have (left out)
    return obj


def _wrap(obj, name: str, label: str, spans: list) -> None:
    fn = getattr(obj, name)
    if asyncio.iscoroutinefunction(fn):
        async def timed_async(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                spans.append((label, t0, time.perf_counter(), None))
        setattr(obj, name, timed_async)
        return

    def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.append((label, t0, time.perf_counter(), time.thread_time() - c0))
    setattr(obj, name, timed)


# (JSON key, what ran just before the step)
COLD_CONDITIONS = (("hot", "nothing (the previous run just ended)"), ("after_wait_1ms", "1 ms busy-wait"),
                   ("after_wait", "50 ms busy-wait"), ("after_wait_reread", "50 ms busy-wait, weights + KV read"),
                   ("after_flush", "256 MB written"), ("after_small_ops", "1 ms of 64 x 64 matmuls"))


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rerun_step(engine: OmniEngine, part: dict, reruns: int) -> dict[str, float]:
    """One more same-prefix request; its step run again ``reruns`` times per condition, alternating."""
    found: dict[str, list[float]] = {}
    run_step = ModelRunner.run
    scratch = torch.empty(256 << 18)  # 256 MB of float32
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    model = engine.runtime.llm.runner.model
    weights = [p for p in model.parameters()]

    def before(condition: str, kv) -> None:
        if condition == "after_wait_1ms":
            _busy_wait(0.001)
        elif condition in ("after_wait", "after_wait_reread"):
            _busy_wait(0.05)
        if condition == "after_wait_reread":  # everything the step reads, back in the caches
            for w in weights:
                w.sum()
            for i in range(len(model.model.layers)):
                for t in kv.layer(i):
                    t.sum()
        elif condition == "after_flush":
            scratch.fill_(1.0)
        elif condition == "after_small_ops":
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                torch.mm(a, b)

    layer_ms = [0.0] * len(model.model.layers)  # this run's wall time per decoder layer

    def timed_layer(i: int, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                layer_ms[i] += (time.perf_counter() - t0) * 1e3
        return call

    def measured(self, entries, kv):
        out = run_step(self, entries, kv)
        if not found:
            found["rows"] = [float(sum(e.num_new_tokens for e in entries))]
            for i, layer in enumerate(model.model.layers):  # instance attributes: removed below
                layer.forward = timed_layer(i, layer.forward)
                layer.forward_logits_rows = timed_layer(i, layer.forward_logits_rows)
            try:
                for _ in range(reruns + 1):  # the first round warms up and is dropped
                    for condition, _ in COLD_CONDITIONS:
                        before(condition, kv)
                        layer_ms[:] = [0.0] * len(layer_ms)
                        t0 = time.perf_counter()
                        run_step(self, entries, kv)
                        found.setdefault(condition, []).append((time.perf_counter() - t0) * 1e3)
                        for i, ms in enumerate(layer_ms):
                            found.setdefault(f"{condition}_layer{i}", []).append(ms)
            finally:
                for layer in model.model.layers:
                    del layer.forward, layer.forward_logits_rows
        return out

    ModelRunner.run = measured
    try:
        # diverges where the first same-prefix request did (after "detail"): the same resume point and rows
        asyncio.run(ttft(engine, ask(part, "Describe the video in detail! Keep it brief.")))
    finally:
        ModelRunner.run = run_step
    return {"rerun_rows": found["rows"][0], "rerun_layers": float(len(layer_ms)),
            **{f"rerun_{key}_ms": statistics.median(found[key][1:]) for key in found if key != "rows"}}


def run(requests: int, reruns: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = new_engine(build_model(Path(tmp)), engine_config(enable_prefix_caching=True,
                                                                                   prefix_checkpoint_every=64))
        try:
            asyncio.run(ttft(engine, ask(data_part("video", make_video(4, **HD, seed=98)), "warm up")))
            part = data_part("video", make_video(12, **HD, seed=200))
            cold = asyncio.run(ttft(engine, ask(part, "Describe the video in detail.")))
            asyncio.run(ttft(engine, [{"role": "user", "content": [
                {"type": "text", "text": "Question 0: how many squares are there?"}, part]}]))
            spans: list = []
            for path, name, label in PARTS:
                owner = _owner(engine, path)
                if hasattr(owner, name):
                    _wrap(owner, name, label, spans)
            per_part: dict[str, list[tuple[float, float, float | None]]] = defaultdict(list)
            firsts = []
            for i in range(requests):
                spans.clear()
                t0 = time.perf_counter()
                firsts.append(asyncio.run(ttft(engine, ask(part, f"Describe the video in detail, but briefly ({i})."))))
                for label, a, b, cpu in spans:
                    per_part[label].append(((a - t0) * 1e3, (b - t0) * 1e3, None if cpu is None else cpu * 1e3))
            reran = rerun_step(engine, part, reruns) if reruns else {}
        finally:
            engine.shutdown()
    out = {"cold_ttft_ms": cold * 1e3, "same_prefix_ttft_ms": statistics.median(firsts) * 1e3,
           "same_prefix_ttft_min_ms": min(firsts) * 1e3, "first_same_prefix_ttft_ms": firsts[0] * 1e3,
           "requests": requests, **reran}
    for label, rows in per_part.items():
        key = label.strip().split(" ")[0].replace("+", "").replace(":", "")
        out[f"{key}_start_ms"] = statistics.median(r[0] for r in rows)
        out[f"{key}_end_ms"] = statistics.median(r[1] for r in rows)
        cpus = [r[2] for r in rows if r[2] is not None]
        if cpus:
            out[f"{key}_cpu_ms"] = statistics.median(cpus)
    out["_rows"] = [(label, statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                     statistics.median(r[2] for r in rows) if rows[0][2] is not None else float("nan"),
                     rows[0][1], rows[0][2] if rows[0][2] is not None else float("nan"))
                    for label, rows in sorted(per_part.items(), key=lambda kv: statistics.median(r[0] for r in kv[1]))]
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="same-prefix requests to take medians over "
                                                                   "(--quick: 20)")
    parser.add_argument("--reruns", type=int, default=30, help="in-place runs of a same-prefix step per cache "
                                                                 "condition (0: none; --quick: 10)")
    args = parser.parse_args()
    if args.requests < 1 or args.reruns < 0:
        parser.error("--requests must be >= 1 and --reruns >= 0")
    reruns = min(args.reruns, 10) if args.quick else args.reruns
    out = run(20 if args.quick else args.requests, reruns)
    rows = out.pop("_rows")
    print_table(f"same-prefix request, medians of {out['requests']} (ms after its clock started; cold "
                f"{out['cold_ttft_ms']:.0f} ms)", ["part", "start", "end", "thread cpu", "1st end", "1st cpu"],
                [*rows, ("first token", 0.0, out["same_prefix_ttft_ms"], float("nan"), out["first_same_prefix_ttft_ms"], float("nan"))])
    if "rerun_rows" in out:
        print_table(f"a same-prefix step ({out['rerun_rows']:.0f} rows) run again in place, medians of "
                    f"{reruns} per condition",
                    ["before the run", "step wall ms", *(f"layer {i}" for i in range(int(out["rerun_layers"])))],
                    [(label, out[f"rerun_{key}_ms"], *(out[f"rerun_{key}_layer{i}_ms"] for i in range(int(out["rerun_layers"]))))
                     for key, label in COLD_CONDITIONS])
    write_json(args.json, out)


if __name__ == "__main__":
    main()
