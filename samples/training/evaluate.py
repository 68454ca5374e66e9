"""Exact-match accuracy of a model on a fresh held-out synthetic set, through ``mmserve caption``.

    python -m samples.training.evaluate --model samples/demo-model --seed 12345 --n 30 \\
        [--max-video-seconds 60] [--warm-check] [--stream-check] [--json eval.json] [--work DIR]

1. ``samples.synthetic.generate`` writes ``n`` images, ``n`` videos (full spec range: up to 60 s) and
   ``n`` audio clips for ``--seed`` (training uses synthetic seeds 10_000..10_099 only).
2. The real CLI captions the directory: ``python -m mm_pipeline.cli caption DIR --model M --out F``
   (a separate process, so everything the server does -- sniffing, decoding, planning, encoder
   batching, streaming prefill -- is exercised). No ``--video-audio`` flag is passed: videos are
   heard as the checkpoint declares (``processor_config.use_audio_in_video``; printed), so a model
   trained with ``--beeping-videos`` is scored on ``video+sound`` with the sound track laid out.
3. Captions are compared to ``labels.jsonl`` (exact string match) per modality; long videos
   (>= 30 s) are also reported on their own. A ``--work`` dir that already holds the same set
   (seed, n) is reused instead of regenerated. ``--warm-check`` runs the job a second time on a warm
   disk encoder cache and counts captions that differ from the cold run; ``--stream-check`` runs it
   cold with embedding streaming off and counts captions that differ from the streamed run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from samples.synthetic.generate import generate

LONG_VIDEO_S = 30.0


def run_caption(model: Path, media_dir: Path, out: Path, cache_dir: Path | None, stream: bool = True) -> float:
    """``mmserve caption`` over ``media_dir`` into ``out``; returns its wall time."""
    cmd = [sys.executable, "-m", "mm_pipeline.cli", "caption", str(media_dir), "--model", str(model),
           "--out", str(out), "--max-tokens", "64", "--device", "cpu"]
    if not stream:
        cmd.append("--no-stream-embeddings")
    if cache_dir is not None:
        cmd += ["--encoder-cache-dir", str(cache_dir)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"mmserve caption failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.time() - t0


def hears_video_sound(model: Path) -> bool:
    """Whether ``mmserve caption`` (no ``--[no-]video-audio``) serves this checkpoint's videos with
    their sound track: its ``processor_config.use_audio_in_video``, true when absent."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return bool((cfg.get("processor_config") or {}).get("use_audio_in_video", True))


def read_captions(out: Path) -> dict[str, dict[str, Any]]:
    recs = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {Path(r["input"]).name: r for r in recs}


def score(labels: list[dict[str, Any]], captions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per group: items, exact matches, accuracy, and the first few misses."""
    groups: dict[str, dict[str, Any]] = {}

    def add(group: str, ok: bool, miss: dict[str, Any] | None) -> None:
        g = groups.setdefault(group, {"n": 0, "correct": 0, "misses": []})
        g["n"] += 1
        g["correct"] += int(ok)
        if miss is not None and len(g["misses"]) < 10:
            g["misses"].append(miss)

    for lab in labels:
        rec = captions.get(lab["path"], {})
        got = rec.get("caption")
        ok = got == lab["caption"]
        miss = None if ok else {"path": lab["path"], "want": lab["caption"], "got": got, "error": rec.get("error")}
        beeping = lab["modality"] == "video" and bool(lab.get("beeps"))
        add("video+sound" if beeping else lab["modality"], ok, miss)  # a group of its own
        if lab["modality"] == "video" and not beeping and lab["duration_s"] >= LONG_VIDEO_S:
            add("video>=30s", ok, miss)
    for g in groups.values():
        g["accuracy"] = g["correct"] / g["n"] if g["n"] else 0.0
    return groups


def _reusable_labels(media: Path, seed: int, n: int, max_video_seconds: float,
                     beeping: int = 0) -> list[dict[str, Any]] | None:
    """The labels of a set an earlier run generated into ``media`` with the same seed and sizes (a
    ``--work`` dir reused across models: generating 60 s videos costs more than captioning them)."""
    path = media / "labels.jsonl"
    if not path.is_file():
        return None
    labels = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sounding = sum(bool(lab.get("beeps")) for lab in labels)
    counts = {m: sum(lab["modality"] == m and not lab.get("beeps") for lab in labels) for m in ("image", "video", "audio")}
    longest = max((lab.get("duration_s", 0.0) for lab in labels if lab["modality"] == "video"), default=0.0)
    if (any(lab["seed"] != seed for lab in labels) or set(counts.values()) != {n}
            or sounding != beeping or longest > max_video_seconds or not all((media / lab["path"]).is_file() for lab in labels)):
        return None
    return labels


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Held-out exact-match accuracy through mmserve caption.")
    ap.add_argument("--model", type=Path, default=Path("samples/demo-model"))
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--n", type=int, default=30, help="items per modality")
    ap.add_argument("--max-video-seconds", type=float, default=60.0)
    ap.add_argument("--beeping-videos", type=int, default=0,
                    help="also this many videos with a sound track of beeps (group video+sound)")
    ap.add_argument("--warm-check", action="store_true", help="second run on a warm encoder cache")
    ap.add_argument("--stream-check", action="store_true",
                    help="another cold run with embedding streaming off (--no-stream-embeddings)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--work", type=Path, default=None, help="keep media and captions here")
    args = ap.parse_args(argv)
    if 10_000 <= args.seed < 10_100:
        raise SystemExit(f"seed {args.seed} is a training seed (10_000..10_099); pick another")

    work = args.work or Path(tempfile.mkdtemp(prefix="mmserve-eval-"))
    media = work / "media"
    labels = _reusable_labels(media, args.seed, args.n, args.max_video_seconds, args.beeping_videos)
    if labels is None:
        labels = generate(args.seed, media, args.n, args.n, args.n, max_video_seconds=args.max_video_seconds,
                          workers=2, beeping_videos=args.beeping_videos)
    cold = work / "captions_cold.jsonl"
    cold.unlink(missing_ok=True)
    cache = work / "encoder-cache" if args.warm_check else None
    wall = run_caption(args.model, media, cold, cache)
    caps = read_captions(cold)
    result: dict[str, Any] = {"model": str(args.model), "seed": args.seed, "n_per_modality": args.n,
                              "video_audio": hears_video_sound(args.model),
                              "caption_wall_s": round(wall, 1), "groups": score(labels, caps)}
    if args.warm_check:
        warm = work / "captions_warm.jsonl"
        warm.unlink(missing_ok=True)
        result["warm_wall_s"] = round(run_caption(args.model, media, warm, cache), 1)
        warm_caps = read_captions(warm)
        result["warm_differs"] = sorted(k for k in caps if warm_caps.get(k, {}).get("caption") != caps[k]["caption"])
    if args.stream_check:
        off = work / "captions_nostream.jsonl"
        off.unlink(missing_ok=True)
        result["nostream_wall_s"] = round(run_caption(args.model, media, off, None, stream=False), 1)
        off_caps = read_captions(off)
        result["nostream_differs"] = sorted(k for k in caps if off_caps.get(k, {}).get("caption") != caps[k]["caption"])
    print(f"held-out seed {args.seed}, {args.n} per modality, mmserve caption wall {wall:.1f} s; videos served "
          f"{'with' if result['video_audio'] else 'without'} their sound (the checkpoint's use_audio_in_video)")
    print(f"{'group':<12} {'n':>4} {'exact':>6} {'accuracy':>9}")
    for name, g in result["groups"].items():
        print(f"{name:<12} {g['n']:>4} {g['correct']:>6} {g['accuracy']:>9.1%}")
    if args.warm_check:
        print(f"warm-cache rerun: {len(result['warm_differs'])} captions differ from the cold run")
    if args.stream_check:
        print(f"streaming off: {len(result['nostream_differs'])} captions differ from the streamed run")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    (work / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"details: {work / 'eval.json'}")


if __name__ == "__main__":
    main()
