"""``make demo`` / ``python -m mm_pipeline.demo``: the whole pipeline on the committed samples.

Captions every file in ``samples/media/`` with the committed demo model ``samples/demo-model/``
through the real pipeline (sniff, decode, preprocess, encoders, streamed prefill, decode), captions
them again to show the encoder cache, and runs one text-only chat (the demo model only learned
captions, so its chat answer is nonsense by design).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.cli import REPO_DEMO_MODEL as DEMO_MODEL
from mm_pipeline.jobs.caption import CaptionConfig, CaptionJob, discover_inputs

ROOT = Path(__file__).resolve().parents[1]
MEDIA = ROOT / "samples" / "media"


def _model_dir() -> Path:
    if not (DEMO_MODEL / "config.json").is_file():
        raise SystemExit(f"the demo model {DEMO_MODEL}/ is missing: restore it with "
                         f"`git checkout -- samples/demo-model` (it is part of the repository)")
    return DEMO_MODEL


def _expected_captions() -> dict[str, str]:
    """Ground-truth captions of the committed samples (file name -> caption), from labels.jsonl."""
    labels = MEDIA / "labels.jsonl"
    if not labels.is_file():
        return {}
    out = {}
    for line in labels.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[Path(rec["path"]).name] = rec["caption"]
    return out


def _short(text: str | None, width: int = 72) -> str:
    # untrained models emit control characters and partial UTF-8: show them as dots
    text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in (text or ""))
    return text if len(text) <= width else text[:width - 1] + "…"


async def _caption_pass(engine, inputs: list[str], out: Path) -> tuple[list[dict], object]:
    records: list[dict] = []
    summary = await CaptionJob(engine, CaptionConfig(max_tokens=48, concurrency=16)).run(
        inputs, out, on_record=records.append)
    order = {p: i for i, p in enumerate(inputs)}
    return sorted(records, key=lambda r: order[r["input"]]), summary


async def _chat(engine, text: str) -> tuple[str, int, float]:
    t0 = time.perf_counter()
    answer, n = "", 0
    async for d in engine.generate([{"role": "user", "content": text}], SamplingParams(max_tokens=24, temperature=0)):
        answer += d.new_text
        n = d.completion_tokens
    return answer, n, time.perf_counter() - t0


async def _run(engine, tmp: Path) -> None:
    inputs = discover_inputs([str(MEDIA)])
    print(f"\ncaptioning {len(inputs)} files from {MEDIA.relative_to(ROOT)}/ "
          f"(default prompts: 'Describe this image.' / video / audio)\n")
    records, first = await _caption_pass(engine, inputs, tmp / "captions.jsonl")
    expected = _expected_captions()
    print(f"{'file':<22} {'modality':<8} {'tokens':>6} {'time s':>7}  {'ok':<3} caption")
    matched = 0
    for r in records:
        cap = r["caption"] if r["error"] is None else f"ERROR {r['error']}"
        want = expected.get(Path(r["input"]).name)
        ok = want is not None and r["error"] is None and cap.strip().lower() == want.strip().lower()
        matched += ok
        mark = "" if want is None else ("yes" if ok else "NO")
        print(f"{Path(r['input']).name:<22} {r['modality'] or '?':<8} {r['completion_tokens']:>6} "
              f"{r['timings'].get('total_s', 0):>7.2f}  {mark:<3} {_short(cap)}")
        if want is not None and not ok:
            print(f"{'':<48}expected: {want}")
    if expected:
        print(f"exact match with samples/media/labels.jsonl: {matched} of {len(records)}")
    for line in first.lines():
        print(line)
    _, second = await _caption_pass(engine, inputs, tmp / "captions-again.jsonl")
    print(f"\nsame files again: {second.elapsed_s:.2f} s vs {first.elapsed_s:.2f} s (encoder outputs from the cache)")
    for line in second.lines()[1:2]:
        print(line)
    answer, n, dt = await _chat(engine, "Write one sentence about sliding-window attention.")
    print(f"\ntext chat: {n} tokens in {dt:.2f} s: {_short(answer, 100)!r}")


def main() -> int:
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.runtime.config import OmniEngineConfig

    with tempfile.TemporaryDirectory(prefix="mmserve-demo-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.perf_counter()
        model_dir = _model_dir()
        engine = OmniEngine.from_pretrained(model_dir, OmniEngineConfig.from_kwargs(num_full_tokens=16384, num_swa_tokens=8192))
        print(f"model: {model_dir}; loaded in {time.perf_counter() - t0:.1f} s")
        try:
            asyncio.run(_run(engine, tmp))
        finally:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
