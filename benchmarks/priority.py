"""Interactive requests behind a batch backlog: ``fcfs`` vs the ``priority`` queue policy, same run.

    .venv/bin/python benchmarks/priority.py [--quick] [--repeat 3] [--json out.json]

A backlog of long low-priority "batch" requests (priority 10) is queued at once; while it runs,
short "interactive" requests (priority 0) arrive one every few engine steps. The engine runs with
few seats (``max_num_seqs``), as a loaded server does. Reported per policy (medians over
``--repeat`` alternating runs): the interactive requests' time to first token and to their last
token, the whole run's makespan and output tokens/s, and the preemptions. Under fcfs an interactive
request waits for the backlog ahead of it; under priority it takes the seat of the least urgent
running request (preempted, recomputed later; the prefix cache keeps its computed pages). Greedy
outputs of both policies are compared (they must be equal: the order requests are served in never
changes a token).

Model: the ``text_throughput.py`` architecture with 4 layers (hidden 256, 16 experts top-2, window
64), fp32, one process, random weights.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
from text_throughput import MODEL

POLICIES = ("fcfs", "priority")


def workload(quick: bool) -> dict:
    return dict(batch=16 if quick else 32, batch_prompt=256 if quick else 512, batch_gen=24 if quick else 48,
                interactive=4 if quick else 8, interactive_prompt=32, interactive_gen=8, every_steps=6,
                seats=8)


def run(model, policy: str, w: dict) -> dict[str, float]:
    engine = LLMEngine(model, EngineConfig(queue_policy=policy, max_num_seqs=w["seats"], max_num_batched_tokens=512,
                                           page_size=16, num_full_tokens=1 << 15, num_swa_tokens=1 << 13))
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, MODEL["vocab_size"], (n,), generator=gen).tolist()

    batch_params = SamplingParams(max_tokens=w["batch_gen"], temperature=0.0, ignore_eos=True)
    chat_params = SamplingParams(max_tokens=w["interactive_gen"], temperature=0.0, ignore_eos=True)
    batch_prompts = [prompt(w["batch_prompt"]) for _ in range(w["batch"])]
    chat_prompts = [prompt(w["interactive_prompt"]) for _ in range(w["interactive"])]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for k, p in enumerate(batch_prompts):
        engine.add_request(f"batch-{k}", p, batch_params, priority=10 if policy == "priority" else 0)
        added[f"batch-{k}"] = t0
    steps = 0
    while engine.has_unfinished() or len(added) < w["batch"] + w["interactive"]:
        k = len(added) - w["batch"]
        if k < w["interactive"] and steps >= 2 + k * w["every_steps"]:
            rid = f"chat-{k}"
            engine.add_request(rid, chat_prompts[k], chat_params)
            added[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
                tokens[out.request_id] = list(out.token_ids)
        steps += 1
    end = time.perf_counter()
    chats = [r for r in added if r.startswith("chat-")]
    return {"interactive_ttft_s": statistics.median(first[r] - added[r] for r in chats),
            "interactive_ttft_max_s": max(first[r] - added[r] for r in chats),
            "interactive_latency_s": statistics.median(done[r] - added[r] for r in chats),
            "makespan_s": end - t0,
            "output_tok_per_s": sum(len(t) for t in tokens.values()) / (end - t0),
            "preemptions": float(engine.scheduler.num_preemptions), "steps": float(steps),
            "_tokens": tokens}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="alternating runs per policy (medians)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    torch.set_num_threads(1)
    w = workload(args.quick)
    cfg = dict(MODEL, num_hidden_layers=4)
    model = load_model(build_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="mmserve-bench-")) / "m", **cfg),
                       dtype=torch.float32)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(args.repeat):
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            runs[policy].append(run(model, policy, w))
    same = all(a["_tokens"] == b["_tokens"] for a, b in zip(runs["fcfs"], runs["priority"]))
    keys = [k for k in runs["fcfs"][0] if not k.startswith("_")]
    med = {p: {k: statistics.median(x[k] for x in runs[p]) for k in keys} for p in POLICIES}
    print_table(f"{w['batch']} batch requests ({w['batch_prompt']} + {w['batch_gen']} tokens, priority 10) and "
                f"{w['interactive']} interactive ({w['interactive_prompt']} + {w['interactive_gen']}, priority 0, "
                f"one every {w['every_steps']} steps), {w['seats']} seats; medians of {args.repeat}",
                ["metric", *POLICIES, "priority / fcfs"],
                [(k, med["fcfs"][k], med["priority"][k], med["priority"][k] / med["fcfs"][k] if med["fcfs"][k] else 0.0)
                 for k in keys])
    print(f"same greedy tokens under both policies: {same}")
    out = {f"{p}_{k}": v for p in POLICIES for k, v in med[p].items()}
    out.update(interactive_ttft_ratio=med["priority"]["interactive_ttft_s"] / med["fcfs"]["interactive_ttft_s"],
               makespan_ratio=med["priority"]["makespan_s"] / med["fcfs"]["makespan_s"], same_tokens=same,
               repeat=args.repeat)
    write_json(args.json, out)
    if not same:
        raise SystemExit("the two policies gave different tokens")


if __name__ == "__main__":
    main()
