"""Where one engine step's time goes: a decode step at batch B and a prefill chunk at batch 1.

Same model and prompts as ``text_throughput.py``. Three views, one run:

1. **Stages** (CPU time of the engine thread, exclusive): the script wraps the engine's stage functions with timers --
   scheduler (schedule + after_step), input preparation (ForwardBatch, embeddings, attention plans,
   rotary tables), attention (projections, KV store, paged attention), MoE (router, experts), dense
   MLP, norms, LM head, sampling, host syncs (``.tolist()`` / ``.item()``: the values the host reads
   back) -- and reports the remainder of the step as "engine / Python other".
   Then transformers' decode step at the same batch (``generate``, eager attention, same weights and
   prompts) split into the same stages by wrapping its module classes (``_hf_stages.py``; ``--no-hf``
   skips it), side by side with ours.
2. **torch.profiler**: the top ATen ops by self CPU time over the same steps.
3. **py-spy** (``--py-spy``, when py-spy is installed): the step loop sampled with native frames;
   the share of samples inside our Python code vs inside torch's native kernels.

``--compile``: the decode step runs compiled (``--compile-decode``, bucket = ``--batch``); the stage
wrappers are then left out (they would split the compiled graphs), so only the step time, the
profiler's top ops and the ATen calls per step are reported.

Nothing here changes what runs: the wrappers only time calls. A stage's time includes its Python.
Times are the engine thread's CPU time (``time.thread_time``): with one intra-op thread (the
default here) that is all of a step's work, and other processes on a shared machine cannot inflate
it the way they inflate wall time (``--wall`` uses wall time instead).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import collections
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json
from _hf_stages import hf_decode_stages, side_by_side
from text_throughput import MODEL, prompts

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


class StageTimer:
    """Exclusive time per stage: a call's time minus the time of stages nested inside it."""

    clock = staticmethod(time.thread_time)

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._stack: list[list[float]] = []  # [start, time of nested stages]
        self._undo: list[tuple[object, str, object]] = []
        self.enabled = False

    def wrap(self, owner: object, name: str, stage: str) -> None:
        original = getattr(owner, name)
        timer = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not timer.enabled:
                return original(*args, **kwargs)
            frame = [timer.clock(), 0.0]
            timer._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                timer._stack.pop()
                spent = timer.clock() - frame[0]
                timer.total[stage] += spent - frame[1]
                timer.calls[stage] += 1
                if timer._stack:
                    timer._stack[-1][1] += spent

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def instrument(timer: StageTimer) -> None:
    """Wrap the stage functions of the text core (class attributes: every instance is timed)."""
    from kernels import ops
    from llm_core.engine import decode_batch_state, model_runner
    from llm_core.engine.sampling import Sampler
    from llm_core.engine.scheduler import Scheduler
    from llm_core.model.layers import attention, fused_decode, mlp, moe, norm
    from llm_core.model.mimo_v2 import MiMoV2ForCausalLM

    timer.wrap(Scheduler, "schedule", "scheduler")
    timer.wrap(Scheduler, "after_step", "scheduler")
    timer.wrap(model_runner, "build_forward_batch", "input preparation")
    timer.wrap(decode_batch_state.DecodeBatchState, "build", "input preparation")
    timer.wrap(model_runner, "splice_embeds", "input preparation")
    timer.wrap(attention.Attention, "_plan", "input preparation")
    timer.wrap(attention.Attention, "_rotary_tables", "input preparation")
    timer.wrap(MiMoV2ForCausalLM, "embed", "input preparation")
    # an all-decode step's layers: one C call each (attention + MLP: not split into the stages below)
    timer.wrap(fused_decode.FusedDecode, "run", "decoder layer (one C call)")
    timer.wrap(attention.Attention, "forward", "attention (proj, rope, store)")
    timer.wrap(attention.Attention, "attend", "attention (proj, rope, store)")
    timer.wrap(attention.Attention, "residual_out", "attention (proj, rope, store)")
    timer.wrap(ops, "paged_attention", "attention (core)")
    timer.wrap(moe.SparseMoE, "forward", "MoE (router, topk)")
    timer.wrap(ops, "fused_experts", "MoE (experts)")
    timer.wrap(mlp.DenseMLP, "forward", "dense MLP")
    timer.wrap(norm.RMSNorm, "forward", "norms")
    timer.wrap(MiMoV2ForCausalLM, "compute_logits", "LM head")
    timer.wrap(MiMoV2ForCausalLM, "greedy_ids", "LM head")
    timer.wrap(Sampler, "sample_isolated", "sampling")
    timer.wrap(torch.Tensor, "tolist", "host syncs (tolist/item)")
    timer.wrap(torch.Tensor, "item", "host syncs (tolist/item)")


def make_engine(model, batch: int, prompt: int, gen: int, compile_decode: bool = False,
                native_kernels: bool = True, persistent_batch: bool = True) -> LLMEngine:
    cfg = EngineConfig(page_size=16, num_full_tokens=batch * (prompt + gen + 32),
                       num_swa_tokens=batch * (64 + prompt + 64), max_num_seqs=batch,
                       max_num_batched_tokens=max(2048, prompt * 8), enable_prefix_caching=False,
                       compile_decode=compile_decode, decode_buckets=(batch,), native_cpu_kernels=native_kernels,
                       persistent_decode_batch=persistent_batch)
    return LLMEngine(model, cfg)


def run_steps(eng: LLMEngine, timer: StageTimer, batch_prompts, gen: int, *, decode: bool, steps: int,
              profiler=None) -> tuple[list[float], int]:
    """Add the prompts; time the prefill step (decode=False) or ``steps`` decode steps. Returns the
    per-step wall times of the timed steps and the tokens they computed."""
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch_prompts):
        eng.add_request(f"p{i}-{time.monotonic_ns()}", p, params)
    if decode:
        eng.step()  # admits the prompts (they wait in the engine's queue until a step)
    if decode:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in
                  (*eng.scheduler.running, *eng.scheduler.waiting)) or eng.scheduler.waiting:
            eng.step()
    times, tokens = [], 0
    timer.enabled = True
    if profiler is not None:
        profiler.__enter__()
    for _ in range(steps if decode else 1):
        n = len(eng.scheduler.running) if decode else sum(len(p) for p in batch_prompts)
        t0 = timer.clock()
        eng.step()
        times.append(timer.clock() - t0)
        tokens += n
    if profiler is not None:
        profiler.__exit__(None, None, None)
    timer.enabled = False
    while eng.has_unfinished():  # drain, untimed
        eng.step()
    return times, tokens


def stage_rows(timer: StageTimer, wall: float, steps: int) -> list[list]:
    rows = []
    accounted = 0.0
    for stage, t in sorted(timer.total.items(), key=lambda kv: -kv[1]):
        accounted += t
        rows.append([stage, 1e3 * t / steps, 100 * t / wall, timer.calls[stage] / steps])
    other = wall - accounted
    rows.append(["engine / Python other", 1e3 * other / steps, 100 * other / wall, 0])
    rows.append(["step total", 1e3 * wall / steps, 100.0, 0])
    return rows


def py_spy_share(out_json: dict, args) -> None:
    """Run the decode loop under ``py-spy record --native`` and split samples by leaf frame."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("\npy-spy: not installed, skipped")
        return
    raw = Path(tempfile.mkdtemp(prefix="mmserve-pyspy-")) / "stacks.txt"
    cmd = [spy, "record", "--native", "-r", "250", "-f", "raw", "-o", str(raw), "--", sys.executable,
           __file__, "--spy-child", "--batch", str(args.batch), "--prompt", str(args.prompt),
           "--steps", str(args.steps), *(["--no-native"] if args.no_native else [])]
    if subprocess.run(cmd, capture_output=True, text=True).returncode != 0 or not raw.exists():
        print("\npy-spy: could not sample (ptrace not permitted?), skipped")
        return
    kinds: dict[str, int] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "decode_loop" not in stack:
            continue  # setup, prefill, imports
        frames = stack.split(";")
        leaf = frames[-1]
        python_frames = [f for f in frames if ".py:" in f]
        last_py = python_frames[-1] if python_frames else ""
        if ".py:" in leaf:
            kind = "python: torch" if "torch/" in leaf else "python: ours"
        elif "libtorch_cpu" in stack.split(last_py)[-1] or "libgomp" in leaf or "mkl" in leaf.lower():
            kind = "native: torch kernels / dispatch"
        else:
            kind = "native: interpreter / other"
        kinds[kind] += int(count)
    total = sum(kinds.values()) or 1
    rows = [[k, v, 100 * v / total] for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    print_table(f"py-spy --native, decode loop at batch {args.batch} (samples by leaf frame)",
                ["where", "samples", "%"], rows)
    for k, v in kinds.items():
        out_json[f"pyspy_pct_{k.split(':')[0]}_{k.split(':')[1].strip().split()[0]}"] = 100 * v / total


def decode_loop(eng: LLMEngine, steps: int) -> None:
    for _ in range(steps):
        eng.step()


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="wall time instead of the engine thread's CPU time")
    p.add_argument("--py-spy", action="store_true", help="also sample the decode loop with py-spy --native")
    p.add_argument("--compile", action="store_true", help="decode through the compiled fixed-shape step "
                   "(no stage timers: they would split its graphs)")
    p.add_argument("--no-persistent-batch", action="store_true",
                   help="rebuild every decode step's inputs (EngineConfig.persistent_decode_batch off)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' decode step split into the same stages")
    p.add_argument("--no-native", action="store_true",
                   help="torch paths only: the C kernels (kernels/native/) off, for A/B runs")
    p.add_argument("--spy-child", action="store_true", help=argparse_hidden())
    args = p.parse_args()
    if args.quick:
        args.prompt, args.steps = min(args.prompt, 128), min(args.steps, 12)
    torch.set_num_threads(args.threads)
    ckpt = build_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="mmserve-prof-")) / "m", **MODEL)
    model = load_model(ckpt, dtype=torch.float32)
    gen = args.steps + 8
    if args.spy_child:
        eng = make_engine(model, args.batch, args.prompt, gen, native_kernels=not args.no_native)
        params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        for i, pr in enumerate(prompts(args.batch, args.prompt, MODEL["vocab_size"])):
            eng.add_request(f"s{i}", pr, params)
        eng.step()
        eng.step()
        decode_loop(eng, args.steps)
        return
    timer = StageTimer()
    if args.wall:
        timer.clock = time.perf_counter
    clock = "wall" if args.wall else "CPU"
    if not args.compile:
        instrument(timer)
    res: dict = {"batch": args.batch, "prompt_tokens": args.prompt, "compiled_decode": args.compile,
                 "native_kernels": not args.no_native, "persistent_decode_batch": not args.no_persistent_batch}
    for label, b, decode in (("decode", args.batch, True), ("prefill", 1, False)):
        eng = make_engine(model, b, args.prompt, gen, compile_decode=args.compile and decode,
                          native_kernels=not args.no_native, persistent_batch=not args.no_persistent_batch)
        batch_prompts = prompts(b, args.prompt, MODEL["vocab_size"])
        run_steps(eng, timer, batch_prompts, gen, decode=decode, steps=4)  # warm-up
        timer.reset()
        times, tokens = run_steps(eng, timer, batch_prompts, gen, decode=decode, steps=args.steps)
        wall, steps = sum(times), len(times)
        rows = stage_rows(timer, wall, steps)
        what = f"one decode step at batch {b}" if decode else f"one prefill chunk of {args.prompt} tokens, batch 1"
        print_table(f"{what} ({tokens / wall:,.0f} tok/s): exclusive {clock} time "
                    f"per step", ["stage", "ms/step", "%", "calls/step"], rows)
        for stage, ms, _, _ in rows:
            key = f"{label}_ms_" + "".join(c if c.isalnum() else "_" for c in stage.lower()).strip("_")
            res[key] = ms
        res[f"{label}_tok_s"] = tokens / wall
        if decode and not args.compile and not args.no_hf:
            ours = {stage: 1e3 * t / steps for stage, t in timer.total.items()}
            hf, hf_total = hf_decode_stages(ckpt, batch_prompts, args.steps, timer)
            table = side_by_side(ours, 1e3 * wall / steps, hf, hf_total)
            print_table(f"the same decode step at batch {b}, ours vs transformers (eager attention, generate): "
                        f"exclusive {clock} ms per step", ["stage", "ours", "transformers", "transformers / ours"],
                        table)
            for group, o, h, _ in table:
                key = "".join(c if c.isalnum() else "_" for c in group.lower().split(" (")[0]).strip("_")
                res[f"hf_decode_ms_{key}"] = h

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        run_steps(eng, timer, batch_prompts, gen, decode=decode, steps=min(args.steps, 8), profiler=prof)
        timer.reset()  # the profile covers the timed steps only (not the prompts' prefill or the drain)
        profiled = min(args.steps, 8) if decode else 1
        calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / profiled
        res[f"{label}_aten_calls_per_step"] = calls
        print(f"\ntorch.profiler, {what}: {calls:,.0f} ATen calls per step; top ATen ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
        eng.close()
    timer.restore()
    if args.py_spy:
        py_spy_share(res, args)
    write_json(args.json, res)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
