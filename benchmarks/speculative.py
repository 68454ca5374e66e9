"""Decode tokens/s with and without MTP speculative decoding on the demo model, same run.

Workloads (greedy):
- caption: the demo model captioning the 10 committed samples (samples/media). Their prompts (token ids
  and the media rows the encoders produced) are recorded once through the real pipeline, then replayed
  straight into the text engine, so only the LLM's prefill and decode are timed;
- text: chat prompts without media, 32 tokens past EOS (the demo model only learned captions, so
  this text is nonsense the MTP head never saw: a low-acceptance workload for the adaptive k).

For each batch size B, groups of B requests cycling over the workload's prompts run one after the
other until every prompt ran (b1: 10 groups, b8: 2, b32: 1 for captions). Decode time = from the step
where every request of a group has its first token to the group's end; decode tok/s = the tokens
generated in those windows / their summed time.
MTP on and off alternate ``--repeats`` times and the fastest run of each counts (a shared machine
slows both alike). The same windows are also timed in process CPU time (``time.process_time``; one
intra-op thread), which other processes on a busy machine inflate far less than wall time: the
"CPU" speedup column. Every greedy output is compared token for token.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.llm import load_tokenizer
from llm_core.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "samples" / "demo-model"
TEXT_PROMPTS = ["Tell me about shapes.", "What colour is the sky?", "Count to five.", "Describe a beep."]


class Rows:
    """An EmbeddingSource whose rows are all ready (recorded media + token embeddings)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self._rows = rows

    def ready_until(self) -> int:
        return self._rows.shape[0]

    def rows(self, start: int, end: int):
        return torch.ones(end - start, dtype=torch.bool), self._rows[start:end]


def caption_prompts(model_dir: Path) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt ids, input rows) of each sample's captioning request, recorded through the pipeline."""
    from samples.training.train_mtp import collect_prompts

    return collect_prompts(model_dir, ROOT / "samples" / "media")


def text_prompts(model_dir: Path) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    out = []
    for t in TEXT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(model, prompts, batch: int, spec: int, max_tokens: int, ignore_eos: bool) -> tuple[float, list[list[int]], dict]:
    """Every prompt at least once, in groups of ``batch`` requests: (decode tok/s over all groups,
    the outputs, speculative stats and ``cpu_tps``: decode tokens per CPU second)."""
    eng = LLMEngine(model, EngineConfig(speculative_tokens=spec, max_num_seqs=max(batch, 1),
                                        enable_prefix_caching=False, kv_cache_bytes=256 << 20))
    n = -(-max(batch, len(prompts)) // batch) * batch
    tokens, seconds, cpu, outs = 0, 0.0, 0.0, []
    for g in range(0, n, batch):
        t, s, c, o = _group(eng, [prompts[i % len(prompts)] for i in range(g, g + batch)], max_tokens, ignore_eos)
        tokens, seconds, cpu, outs = tokens + t, seconds + s, cpu + c, outs + o
    stats = eng.stats()
    return tokens / max(seconds, 1e-9), outs, dict(accepted=stats.spec_mean_accepted_tokens,
                                                   rate=stats.spec_acceptance_rate, cpu_tps=tokens / max(cpu, 1e-9))


def _group(eng: LLMEngine, group, max_tokens: int, ignore_eos: bool) -> tuple[int, float, float, list[list[int]]]:
    """One batch to completion: (tokens generated after every request's first, their wall seconds,
    their process CPU seconds, outputs)."""
    batch = len(group)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    for i, (ids, rows) in enumerate(group):
        eng.add_request(str(i), ids, params, embeds=None if rows is None else Rows(rows))
    outs: dict[str, list[int]] = {}
    first = {}
    t_decode = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.token_ids:
                first.setdefault(o.request_id, len(o.token_ids))
            if o.finished:
                outs[o.request_id] = o.token_ids
        if t_decode is None and len(first) == batch:
            t_decode, c_decode, n_first = time.perf_counter(), time.process_time(), sum(first.values())
    elapsed, cpu = time.perf_counter() - t_decode, time.process_time() - c_decode
    generated = sum(len(v) for v in outs.values()) - n_first
    return generated, elapsed, cpu, [outs[str(i)] for i in range(batch)]


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--workload", choices=("all", "caption", "text"), default="all",
                    help="run one workload only (text's decode windows are short: more --repeats for it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = (1, 8) if args.quick else (1, 8, 32)
    repeats = 1 if args.quick else args.repeats
    model = load_model(args.model)
    workloads = {}
    if args.workload in ("all", "caption"):
        workloads["caption"] = ([(ids, rows) for ids, rows in caption_prompts(args.model)], 64, False)
    if args.workload in ("all", "text"):
        workloads["text"] = ([(ids, None) for ids in text_prompts(args.model)], 32, True)
    results: dict[str, float] = {}
    rows_out = []
    identical = True
    accepted_all = []
    for name, (prompts, max_tokens, ignore_eos) in workloads.items():
        for spec in (0, args.spec_tokens):  # warm-up, not timed: the process's first engine runs pay
            run(model, prompts[:1], 1, spec, max_tokens, ignore_eos)  # one-off costs (allocator, MKL, folds)
        for b in batches:
            best = {0: 0.0, args.spec_tokens: 0.0}
            best_cpu = dict(best)
            acc = []
            outs = {}
            for _ in range(repeats):
                for spec in (0, args.spec_tokens):
                    tps, toks, st = run(model, prompts, b, spec, max_tokens, ignore_eos)
                    best[spec] = max(best[spec], tps)
                    best_cpu[spec] = max(best_cpu[spec], st["cpu_tps"])
                    outs.setdefault(spec, toks)
                    if spec:
                        acc.append(st["accepted"])
            same = outs[0] == outs[args.spec_tokens]
            identical &= same
            speedup = best[args.spec_tokens] / best[0]
            cpu_speedup = best_cpu[args.spec_tokens] / best_cpu[0]
            mean_acc = statistics.median(acc)
            accepted_all.append(mean_acc)
            key = f"mtp_decode_speedup_b{b}" if name == "caption" else f"mtp_text_decode_speedup_b{b}"
            results[key] = round(speedup, 3)
            results[key.replace("_speedup_", "_cpu_speedup_")] = round(cpu_speedup, 3)
            results[f"mtp_{name}_accepted_tokens_b{b}"] = round(mean_acc, 3)
            rows_out.append((name, b, best[0], best[args.spec_tokens], speedup, cpu_speedup, mean_acc,
                             "yes" if same else "NO"))
    if "caption" in workloads:
        results["mtp_mean_accepted_tokens"] = round(statistics.mean(
            results[f"mtp_caption_accepted_tokens_b{b}"] for b in batches), 3)
    results["mtp_outputs_identical"] = int(identical)
    print_table(f"MTP speculative decoding, demo model, {args.spec_tokens} draft tokens (adaptive), "
                f"{args.threads} thread(s), best of {repeats}",
                ["workload", "batch", "decode tok/s off", "decode tok/s MTP", "speedup", "CPU speedup", "tokens / verify",
                 "identical"],
                rows_out)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
