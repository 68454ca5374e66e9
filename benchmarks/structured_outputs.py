"""Structured outputs: what a constraint costs per decode step, what compiling costs, and how a
schema that would compile for minutes is answered.

    .venv/bin/python benchmarks/structured_outputs.py --quick --json /tmp/structured.json

Model: a random tiny MiMo-V2 checkpoint (samples.checkpoints.tiny_text) with the demo checkpoint's
tokenizer (its ids fit the model's 512), fp32 on CPU, one intra-op thread. For each batch size B,
B prompts decode ``--gen`` tokens greedily, unconstrained (ignore_eos) and under each constraint:
an unbounded regex (``[a-z ]+``) and a JSON schema (an object whose string needs 400 characters):
neither can complete within the run, so every row decodes exactly ``--gen`` tokens. Plain and constrained runs
alternate ``--repeats`` times, the fastest of each counts; the rate is generated tokens / seconds.

Compile rows: the worker's start (spawn + import xgrammar), one schema's first compile (worker up)
and a cached compile; the hostile row times ``compile`` of a schema whose string pattern holds
``c{1,50000}`` (~270 s in-process) under a ``--timeout`` second limit, and then a normal compile
(the fresh worker's start included).

Keys: tokens_per_s_{plain,regex,json}_b{B}, overhead_{regex,json}_b{B} (plain rate / constrained rate),
worker_start_s, compile_cold_ms, compile_cached_us, hostile_answered_s, after_hostile_compile_s.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.structured import StructuredOutputsParams
from llm_core.engine.structured.compiler import GrammarCompiler, GrammarError
from llm_core.llm import load_tokenizer
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "samples" / "demo-model"
EOS = 258  # the demo tokenizer's <|im_end|>
# neither can complete within --gen tokens, so every row of every variant decodes max_tokens (a row
# that completed early would shrink the batch and flatter the rate)
CONSTRAINTS = {"regex": StructuredOutputsParams(regex="[a-z ]+"),
               "json": StructuredOutputsParams(json={"type": "object", "required": ["text"], "properties": {
                   "text": {"type": "string", "minLength": 400}}})}
HOSTILE = StructuredOutputsParams(json={"type": "string", "pattern": "(a|b)*c{1,50000}"})


def decode_rates(llm: LLM, batch: int, gen: int, repeats: int) -> dict[str, float]:
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(batch)]
    variants = {"plain": SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)}
    variants.update({k: SamplingParams(max_tokens=gen, temperature=0.0, structured_outputs=c)
                     for k, c in CONSTRAINTS.items()})
    for p in variants.values():  # warm-up: compiles, first steps
        llm.generate(prompts, p)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, p in variants.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, p)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
            if any(len(o.token_ids) != p.max_tokens for o in outs):
                raise SystemExit(f"{name}: a row ended before max_tokens; the rates would not compare")
            best[name] = max(best.get(name, 0.0), rate)
    return best


def compile_costs(tokenizer, timeout_s: float) -> dict[str, float]:
    compiler = GrammarCompiler(tokenizer, 512, [EOS], timeout_s=timeout_s)
    try:
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(regex="x"))
        start = time.perf_counter() - t0
        schema = StructuredOutputsParams(json={"type": "object", "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
            "size": {"type": "integer", "minimum": 0}}, "required": ["name", "size"]})
        t0 = time.perf_counter()
        compiler.compile(schema)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(100):
            compiler.compile(schema)
        cached = (time.perf_counter() - t0) / 100
        t0 = time.perf_counter()
        try:
            compiler.compile(HOSTILE)
            raise SystemExit("the hostile schema compiled within the limit: raise its repetition count")
        except GrammarError:
            hostile = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(regex="y"))
        after = time.perf_counter() - t0
    finally:
        compiler.close()
    return {"worker_start_s": start, "compile_cold_ms": cold * 1e3, "compile_cached_us": cached * 1e6,
            "hostile_answered_s": hostile, "after_hostile_compile_s": after}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--gen", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=2.0, help="compile time limit for the hostile row")
    args = p.parse_args()
    torch.set_num_threads(1)
    batches = (1, 8) if args.quick else (1, 8, 32)
    gen = 32 if args.quick else args.gen
    tokenizer = load_tokenizer(DEMO_TOKENIZER)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build_tiny_hf_checkpoint(Path(tmp) / "tiny", eos_token_id=EOS), dtype=torch.float32)
        llm = LLM.from_engine(LLMEngine(model, EngineConfig(num_full_tokens=1 << 15, num_swa_tokens=1 << 13),
                                        tokenizer=tokenizer))
        rows = []
        for b in batches:
            rates = decode_rates(llm, b, gen, args.repeats)
            for name, rate in rates.items():
                results[f"tokens_per_s_{name}_b{b}"] = rate
            for name in CONSTRAINTS:
                results[f"overhead_{name}_b{b}"] = rates["plain"] / rates[name]
            rows.append([b, rates["plain"], rates["regex"], rates["json"], rates["plain"] / rates["regex"],
                         rates["plain"] / rates["json"]])
        llm.engine.close()
    print_table(f"decode tokens/s, greedy, {gen} tokens per prompt (best of {args.repeats})",
                ["batch", "plain", "regex", "json", "plain/regex", "plain/json"], rows)
    costs = compile_costs(tokenizer, args.timeout)
    results.update(costs)
    print_table("compiling", ["what", "value"],
                [["worker start (s)", costs["worker_start_s"]], ["schema, first compile (ms)", costs["compile_cold_ms"]],
                 ["schema, cached (us)", costs["compile_cached_us"]],
                 [f"hostile schema answered, limit {args.timeout:g} s (s)", costs["hostile_answered_s"]],
                 ["next compile, fresh worker (s)", costs["after_hostile_compile_s"]]])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
