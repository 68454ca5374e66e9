"""Decode step time with the linear weights row-major (as loaded) vs column-major (what the model
runner installs on CPU: ``kernels.ops.linear_weight_layout``), in one process, alternating.

Same model and prompts as ``text_throughput.py``. For each batch size B and each layout, a fresh engine
prefills B prompts, then ``--steps`` decode steps are timed (CPU time of this thread: one intra-op
thread, so that is all of a step's work). The layouts alternate ``--repeats`` times so load from other
processes falls on both; the table gives medians. The expert stacks keep their column-major layout in
both (that is not what is compared), and the tokens of both layouts are checked equal.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, print_table, write_json
from text_throughput import MODEL, prompts
from torch import nn

from kernels import ops
from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


def decode_ms(model, batch: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """CPU ms per decode step over ``steps`` steps after the prompts' prefill, and the tokens."""
    b, prompt = len(batch), len(batch[0])
    eng = LLMEngine(model, EngineConfig(page_size=16, num_full_tokens=b * (prompt + steps + 48),
                                        num_swa_tokens=b * (prompt + 128), max_num_seqs=b,
                                        max_num_batched_tokens=max(2048, prompt * 8), enable_prefix_caching=False))
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        eng.add_request(f"w{i}", p, params)
    final: dict[str, list[int]] = {}

    def step() -> None:
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids

    step()  # admits the prompts (they wait in the engine's queue until a step)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        step()
    step()
    t0 = time.thread_time()
    for _ in range(steps):
        step()
    ms = 1e3 * (time.thread_time() - t0) / steps
    while eng.has_unfinished():
        step()
    eng.close()
    return ms, [final[f"w{i}"] for i in range(b)]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 3)
    torch.set_num_threads(1)
    ckpt = build_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="mmserve-layout-")) / "m", **MODEL)
    model = load_model(ckpt, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    row_major = {id(m): m.weight.data.contiguous() for m in linears}
    column_major = ops.linear_weight_layout

    def use(layout: str) -> None:
        # the runner re-lays weights when an engine is built: the row-major run turns that off
        ops.linear_weight_layout = column_major if layout == "column-major" else (lambda w: w)
        for m in linears:
            m.weight.data = row_major[id(m)]

    rows, res = [], {"prompt_tokens": args.prompt, "steps": args.steps, "repeats": args.repeats}
    for b in (int(x) for x in args.batches.split(",")):
        batch = prompts(b, args.prompt, MODEL["vocab_size"])
        times: dict[str, list[float]] = {"row-major": [], "column-major": []}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for layout in times:
                use(layout)
                ms, tokens[layout] = decode_ms(model, batch, args.steps)
                times[layout].append(ms)
        use("column-major")
        row, col = statistics.median(times["row-major"]), statistics.median(times["column-major"])
        same = sum(a == c for a, c in zip(tokens["row-major"], tokens["column-major"]))
        rows.append([b, row, col, col / row, f"{same}/{b}"])
        res.update({f"row_major_decode_ms_b{b}": row, f"column_major_decode_ms_b{b}": col,
                    f"layout_ratio_b{b}": col / row, f"same_tokens_b{b}": same / b})
    print_table(f"decode step, CPU ms (median of {args.repeats} alternating runs)",
                ["batch", "row-major", "column-major", "column / row", "same tokens"], rows)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
