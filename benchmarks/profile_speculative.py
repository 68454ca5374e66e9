"""Where one MTP speculative decode step's CPU time goes, demo model (batch 1 captions unless told).

Same workloads as ``speculative.py`` (``--workload caption``: caption prompts recorded once, replayed
into the text engine, greedy, 64 tokens; ``text``: chat prompts, 32 tokens past EOS), ``--batch B``
requests decoding together (groups cycling over the prompts; a group's decode steps start when every
request of it has its first token). The engine's stage functions are wrapped with ``profile_step.StageTimer``
(exclusive CPU time of the engine thread) and the decode steps of every request are summed; each
stage is reported in ms per engine step, for MTP off and on, plus the tokens per step:

    scheduler        Scheduler.schedule / after_step
    draft: inputs    the draft steps' ForwardBatch, embeddings, attention plans, rotary tables
    draft: MTP layer the draft steps' MTP layer forwards (projections, KV store, MLP, norms)
    draft: attention core   their paged attention
    draft: LM head   the draft steps' logits + argmax
    draft: fused steps   FusedDraft.draft, all k steps (folded weights, fused_draft.py; one C call,
                     kernels/native/mtp_draft.c, with the native kernels on)
    draft: other     the rest of MTPProposer.draft (tails, concatenations, host reads)
    target: inputs   the target's ForwardBatch, embeddings, plans, rotary tables
    target forward   the main model's layers
    extend           MTPProposer.extend (the MTP layer over the target's rows)
    LM head          the target's logits
    verify/sample    acceptance (verify.py, logprobs) or the plain sampler
    settle           the engine appending 1..k+1 tokens with stop checks
    other            the rest of the step

Nothing here changes what runs: the wrappers only time calls.

A second table counts ATen dispatches per decode step with torch.profiler (top-level ops: an op
called inside another op is not counted again), split into the draft, the target forward, the MTP
extend and the rest of the step. On this small model a step's cost is mostly per-dispatch overhead,
and unlike CPU time on a shared machine the count does not swing from run to run.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import contextlib
from collections import Counter
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json
from profile_step import StageTimer
from speculative import DEMO, Rows, caption_prompts, text_prompts

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model


class Phase:
    """Tags the time of stages nested in a call (draft / target) with a prefix."""

    def __init__(self) -> None:
        self.name = "target"

    def wrap(self, owner: object, attr: str, name: str) -> None:
        original, phase = getattr(owner, attr), self

        def tagged(*args, **kwargs):
            before, phase.name = phase.name, name
            try:
                return original(*args, **kwargs)
            finally:
                phase.name = before

        setattr(owner, attr, tagged)


def instrument(timer: StageTimer, phase: Phase) -> None:
    from kernels import ops
    from llm_core.engine import llm_engine, model_runner
    from llm_core.engine.sampling import Sampler
    from llm_core.engine.scheduler import Scheduler
    from llm_core.engine.speculative import proposer, runner
    from llm_core.model.layers import attention
    from llm_core.model.mimo_v2 import MiMoV2ForCausalLM
    from llm_core.model.mtp import MTPLayer

    def by_phase(owner, attr, stage):  # the stage's time goes to "<phase>: <stage>"
        original = getattr(owner, attr)
        wrapped = {}

        def call(*args, **kwargs):
            key = f"{phase.name}: {stage}"
            if key not in wrapped:
                holder = type("H", (), {"f": staticmethod(original)})
                timer.wrap(holder, "f", key)
                wrapped[key] = holder.f
            return wrapped[key](*args, **kwargs)

        setattr(owner, attr, call)

    timer.wrap(Scheduler, "schedule", "scheduler")
    timer.wrap(Scheduler, "after_step", "scheduler")
    for mod in (model_runner, runner, proposer):
        if hasattr(mod, "build_forward_batch"):
            by_phase(mod, "build_forward_batch", "inputs (batch)")
    by_phase(runner, "splice_embeds", "inputs (embed)")
    by_phase(model_runner, "splice_embeds", "inputs (embed)")
    by_phase(attention.Attention, "_plan", "inputs (attention plan)")
    by_phase(attention.Attention, "_rotary_tables", "inputs (rotary)")
    by_phase(MiMoV2ForCausalLM, "embed", "inputs (embed)")
    by_phase(ops, "paged_attention", "attention core")
    if hasattr(proposer, "DraftSteps"):  # the draft steps' inputs built once (llm_core/engine/speculative/draft_steps.py)
        timer.wrap(proposer.DraftSteps, "__init__", "draft: inputs (all steps, once)")
        timer.wrap(proposer.DraftSteps, "batch", "draft: inputs (batch)")
    if hasattr(proposer, "FusedDraft"):  # mode first: the k draft steps from folded weights (fused_draft.py)
        timer.wrap(proposer.FusedDraft, "draft", "draft: fused steps (all k)")
    by_phase(MiMoV2ForCausalLM, "compute_logits", "LM head")
    timer.wrap(MiMoV2ForCausalLM, "forward", "target forward")
    by_phase(MTPLayer, "forward", "MTP layer")
    timer.wrap(proposer.MTPProposer, "draft", "draft: other")
    timer.wrap(proposer.MTPProposer, "extend", "extend")
    timer.wrap(runner.SpeculativeRunner, "_verify", "verify/sample")
    timer.wrap(Sampler, "sample_isolated", "verify/sample")
    timer.wrap(llm_engine.LLMEngine, "_hand_out", "settle")
    timer.wrap(llm_engine.LLMEngine, "_step", "other")
    phase.wrap(proposer.MTPProposer, "draft", "draft")
    phase.wrap(proposer.MTPProposer, "extend", "extend")


def decode_profile(model, prompts, spec: int, max_tokens: int, timer: StageTimer, batch: int = 1,
                   ignore_eos: bool = False) -> tuple[dict, int, int]:
    """(ms per decode step by stage, decode steps, tokens generated in them) over every prompt, in
    groups of ``batch`` requests (cycling over the prompts, as speculative.py does). A group's decode
    steps are those after every request of it has its first token."""
    eng = LLMEngine(model, EngineConfig(speculative_tokens=spec, max_num_seqs=batch, enable_prefix_caching=False,
                                        kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    steps = tokens = 0
    timer.reset()
    n = -(-max(batch, len(prompts)) // batch) * batch
    for g in range(0, n, batch):
        for i in range(g, g + batch):
            ids, rows = prompts[i % len(prompts)]
            eng.add_request(str(i), ids, params, embeds=None if rows is None else Rows(rows))
        seen: dict[str, int] = {}
        decoding = False
        while eng.has_unfinished():
            timer.enabled = decoding
            for o in eng.step():
                if decoding:
                    tokens += len(o.token_ids) - seen.get(o.request_id, 0)
                seen[o.request_id] = len(o.token_ids)
            steps += timer.enabled
            decoding = decoding or (len(seen) == batch and all(seen.values()))
        timer.enabled = False
    return {k: 1e3 * v / max(steps, 1) for k, v in timer.total.items()}, steps, tokens


DISPATCH_PHASES = {"draft": ("llm_core.engine.speculative.proposer", "MTPProposer", "draft"),
                   "target forward": ("llm_core.model.mimo_v2", "MiMoV2ForCausalLM", "forward"),
                   "extend": ("llm_core.engine.speculative.proposer", "MTPProposer", "extend"),
                   "step": ("llm_core.engine.llm_engine", "LLMEngine", "_step")}


@contextlib.contextmanager
def labelled_phases():
    """Each DISPATCH_PHASES call runs inside a torch.profiler record_function of its name."""
    import importlib

    saved = []
    for name, (module, cls, attr) in DISPATCH_PHASES.items():
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, attr)

        def labelled(*args, _f=original, _name=name, **kwargs):
            with torch.profiler.record_function(_name):
                return _f(*args, **kwargs)

        setattr(owner, attr, labelled)
        saved.append((owner, attr, original))
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def dispatch_counts(model, prompts, spec: int, max_tokens: int, ignore_eos: bool = False) -> tuple[dict[str, float], float]:
    """(top-level ATen ops per decode step by phase, tokens per decode step) over ``prompts`` at batch 1."""
    eng = LLMEngine(model, EngineConfig(speculative_tokens=spec, max_num_seqs=1, enable_prefix_caching=False,
                                        kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)
    steps = tokens = 0
    with labelled_phases():
        for i, (ids, rows) in enumerate(prompts):
            eng.add_request(str(i), ids, params, embeds=None if rows is None else Rows(rows))
            seen = 0
            while eng.has_unfinished():
                if seen:  # decode steps only: the prompt's step is not profiled
                    prof.start()
                outs = eng.step()
                if seen:
                    prof.stop()
                    steps += 1
                for o in outs:
                    tokens += len(o.token_ids) - seen if seen else 0
                    seen = len(o.token_ids)
    counts: Counter = Counter()
    for ev in prof.events():
        if ev.name not in DISPATCH_PHASES:
            continue
        todo = list(ev.cpu_children)
        while todo:
            child = todo.pop()
            if child.name.startswith("aten::"):
                counts[ev.name] += 1  # a top-level op; the ops it calls are not counted again
            else:
                todo.extend(child.cpu_children)
    per_step = {k: v / max(steps, 1) for k, v in counts.items()}
    per_step["other"] = per_step.get("step", 0.0) - sum(v for k, v in per_step.items() if k != "step")
    return per_step, tokens / max(steps, 1)


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (the dispatch table stays batch 1)")
    ap.add_argument("--workload", choices=("caption", "text"), default="caption",
                    help="speculative.py's workloads: captions of the samples, or text (drafts mostly fail)")
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    torch.set_num_threads(1)
    model = load_model(args.model)
    if args.workload == "caption":
        prompts, max_tokens, ignore_eos = caption_prompts(args.model), 64, False
    else:
        prompts, max_tokens, ignore_eos = [(ids, None) for ids in text_prompts(args.model)], 32, True
    what = f"batch {args.batch}, demo model {args.workload}"
    timer, phase = StageTimer(), Phase()
    instrument(timer, phase)
    runs: dict[int, list] = {0: [], args.spec_tokens: []}
    for _ in range(1 if args.quick else args.repeats):  # alternate: a busy machine slows both alike
        for spec in runs:
            runs[spec].append(decode_profile(model, prompts, spec, max_tokens, timer, args.batch, ignore_eos))
    best = {spec: min(rs, key=lambda r: sum(r[0].values())) for spec, rs in runs.items()}
    stages = sorted({k for r in best.values() for k in r[0]}, key=lambda k: -best[args.spec_tokens][0].get(k, 0))
    rows = [(k, *(round(best[s][0].get(k, 0.0), 3) for s in runs)) for k in stages]
    rows.append(("step total", *(round(sum(best[s][0].values()), 3) for s in runs)))
    per_tok = {s: sum(best[s][0].values()) * best[s][1] / max(best[s][2], 1) for s in runs}
    rows.append(("tokens per step", *(round(best[s][2] / max(best[s][1], 1), 3) for s in runs)))
    rows.append(("ms CPU per token", *(round(per_tok[s], 3) for s in runs)))
    print_table(f"MTP decode step, {what}, CPU ms per step (lowest-total of "
                f"{len(runs[0])} alternating runs)", ["stage", "MTP off", f"MTP k={args.spec_tokens}"], rows)
    timer.restore()
    ops = {s: dispatch_counts(model, prompts[:3] if args.quick else prompts, s, max_tokens, ignore_eos) for s in runs}
    names = ["draft", "target forward", "extend", "other", "step"]
    rows = [(n if n != "step" else "step total", *(round(ops[s][0].get(n, 0.0), 1) for s in runs)) for n in names]
    rows.append(("tokens per step", *(round(ops[s][1], 3) for s in runs)))
    per_tok_ops = {s: ops[s][0].get("step", 0.0) / max(ops[s][1], 1e-9) for s in runs}
    rows.append(("dispatches per token", *(round(per_tok_ops[s], 1) for s in runs)))
    print_table(f"ATen dispatches per decode step (torch.profiler, top-level ops), batch 1, demo model {args.workload}",
                ["phase", "MTP off", f"MTP k={args.spec_tokens}"], rows)
    # batch-1 captions keep their historical keys; other runs name their batch and workload
    key = "mtp_b1" if (args.batch, args.workload) == (1, "caption") else f"mtp_{args.workload}_b{args.batch}"
    write_json(args.json, {f"{key}_cpu_ms_per_token_off": round(per_tok[0], 3),
                           f"{key}_cpu_ms_per_token_k{args.spec_tokens}": round(per_tok[args.spec_tokens], 3),
                           f"{key}_cpu_speedup": round(per_tok[0] / per_tok[args.spec_tokens], 3),
                           f"{key}_dispatches_per_step_off": round(ops[0][0].get("step", 0.0), 1),
                           f"{key}_dispatches_per_step_k{args.spec_tokens}":
                               round(ops[args.spec_tokens][0].get("step", 0.0), 1),
                           f"{key}_dispatch_ratio": round(per_tok_ops[0] / max(per_tok_ops[args.spec_tokens], 1e-9), 3)})


if __name__ == "__main__":
    main()
