"""Prompt scoring (vLLM's ``prompt_logprobs``; what lm-eval's loglikelihood tasks ask through echo +
logprobs): what scoring every prompt token costs over a plain prefill, against transformers doing
the same (one forward, log_softmax of every row), with the values compared in the same run.

    .venv/bin/python benchmarks/prompt_scoring.py --quick --json /tmp/prompt_scoring.json

Model: a random tiny MiMo-V2 checkpoint (samples.checkpoints.tiny_text) with a ``--vocab``-sized
vocabulary (the LM head over every prompt row is what scoring adds, and it grows with the
vocabulary), fp32 on CPU, one intra-op thread. For each batch size B: B distinct prompts of
``--prompt`` tokens, one generated token each, plain (no prefix-cache hit: every prompt is new) and
with ``prompt_logprobs`` 0 and 5; transformers runs one forward per prompt and takes the
log_softmax of every row. Variants alternate ``--repeats`` times, the fastest of each counts; the
rate is prompt tokens / second.

Keys: tokens_per_s_{plain,score0,score5,hf}_b{B}, overhead_score{0,5}_b{B} (plain rate / scoring
rate), hf_over_score0_b{B} (our scoring rate / transformers'), max_abs_diff (ours vs transformers,
over every scored token of the run).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def ours(model, batch: list[list[int]], prompt_logprobs: int | None) -> tuple[float, list]:
    """Seconds to score ``batch`` on a fresh engine (so no prefix-cache hit), and its outputs."""
    eng = LLMEngine(model, EngineConfig(page_size=16, num_full_tokens=1 << 15, num_swa_tokens=1 << 14,
                                        max_num_batched_tokens=2048))
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        eng.add_request(str(i), p, sp)
    done = {}
    while len(done) < len(batch):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return time.perf_counter() - t0, [done[str(i)] for i in range(len(batch))]


def hf(hf_model, batch: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    t0 = time.perf_counter()
    out = []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p])
            lp = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
            out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return time.perf_counter() - t0, out


def main() -> None:
    ap = base_parser(__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; --quick 256)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size of the random checkpoint")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 8; --quick 1 4)")
    ap.add_argument("--repeats", type=int, default=None, help="alternations (default 3; --quick 2)")
    args = ap.parse_args()
    length = args.prompt or (256 if args.quick else 512)
    batches = args.batch or ([1, 4] if args.quick else [1, 8])
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(1)
    from transformers import MiMoV2FlashForCausalLM

    results: dict[str, float] = {}
    rows = []
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_hf_checkpoint(Path(tmp) / "hf", vocab_size=args.vocab, max_position_embeddings=4096)
        model = load_model(path, dtype=torch.float32)
        hf_model = MiMoV2FlashForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        for b in batches:
            best = {k: float("inf") for k in ("plain", "score0", "score5", "hf")}
            for r in range(repeats):
                batch = prompts(b, length, args.vocab, seed=1000 * b + r)
                best["plain"] = min(best["plain"], ours(model, batch, None)[0])
                t, scored = ours(model, batch, 0)
                best["score0"] = min(best["score0"], t)
                best["score5"] = min(best["score5"], ours(model, batch, 5)[0])
                t, ref = hf(hf_model, batch)
                best["hf"] = min(best["hf"], t)
                for o, want in zip(scored, ref):
                    got = torch.tensor(o.prompt_logprobs[1:])
                    worst = max(worst, float((got - want).abs().max()))
            tokens = b * length
            for k, s in best.items():
                results[f"tokens_per_s_{k}_b{b}"] = tokens / s
            results[f"overhead_score0_b{b}"] = best["score0"] / best["plain"]
            results[f"overhead_score5_b{b}"] = best["score5"] / best["plain"]
            results[f"hf_over_score0_b{b}"] = best["hf"] / best["score0"]
            rows.append([b, tokens / best["plain"], tokens / best["score0"], tokens / best["score5"], tokens / best["hf"],
                         results[f"overhead_score0_b{b}"], results[f"hf_over_score0_b{b}"]])
    results["max_abs_diff"] = worst
    print_table(f"prompt tokens/s, {length}-token prompts, vocabulary {args.vocab} (fastest of {repeats})",
                ["batch", "plain prefill", "prompt_logprobs=0", "prompt_logprobs=5", "transformers",
                 "scoring cost x", "ours / transformers x"], rows)
    print(f"\nlargest |ours - transformers| over every scored token: {worst:.2e}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
