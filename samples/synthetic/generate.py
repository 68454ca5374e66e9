"""CLI + library entry: generate synthetic caption-task media and a ``labels.jsonl``.

    python -m samples.synthetic.generate --seed 0 --out /tmp/synth --images 8 --videos 2 --audios 4 \\
        [--beeping-videos 2] [--max-video-seconds 6] [--image-format png] [--video-format webm] [--audio-format opus] \\
        [--workers 2]

Each line of ``labels.jsonl`` is one item::

    {"path": "image_000003.jpg", "modality": "image", "prompt": "Describe this image.",
     "caption": "a red circle and a blue square", "seed": 0, "index": 3, "width": ..., ...}

A beeping video (``video_sound_*``) is a video with a sound track of beeps; its label's modality
is "video" and its caption names the colours, then the beeps ("a square that is red, then blue;
beeps: low, high").

``path`` is relative to the directory holding ``labels.jsonl``. Item ``i`` of a modality depends only
on (seed, modality, i, forced format, max video seconds), never on the other counts.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from samples.synthetic.audio_gen import write_audio
from samples.synthetic.image_gen import write_image
from samples.synthetic.sampler import sample_audio, sample_beeping_video, sample_image, sample_video
from samples.synthetic.spec import (
    AUDIO_FORMATS, FILE_EXTENSIONS, IMAGE_FORMATS, PROMPTS, VIDEO_DURATION_MAX_S, VIDEO_FORMATS,
    AudioSpec, ImageSpec, VideoSpec,
)
from samples.synthetic.video_gen import write_video

LABELS_FILE = "labels.jsonl"
Spec = ImageSpec | VideoSpec | AudioSpec


@dataclass(frozen=True)
class ItemJob:
    """What one worker needs to sample and write one item."""

    modality: str
    seed: int
    index: int
    fmt: str | None
    max_video_seconds: float


def sample_spec(job: ItemJob) -> Spec:
    """The item's parameters (no file written)."""
    if job.modality == "image":
        return sample_image(job.seed, job.index, job.fmt)
    if job.modality == "video":
        return sample_video(job.seed, job.index, job.fmt, job.max_video_seconds)
    if job.modality == "audio":
        return sample_audio(job.seed, job.index, job.fmt)
    if job.modality == "beeping_video":
        return sample_beeping_video(job.seed, job.index, job.fmt, job.max_video_seconds)
    raise ValueError(f"unknown modality {job.modality!r}")


def label(job: ItemJob, spec: Spec, rel_path: str) -> dict[str, Any]:
    """The ``labels.jsonl`` record of one item."""
    modality = "video" if job.modality == "beeping_video" else job.modality  # what the server sees
    return {"path": rel_path, "modality": modality, "prompt": PROMPTS[modality],
            "caption": spec.caption, "seed": job.seed, "index": job.index, **spec.to_json()}


def write_item(job: ItemJob, out_dir: Path) -> dict[str, Any]:
    """Sample, render and encode one item into ``out_dir``; returns its label."""
    spec = sample_spec(job)
    stem = "video_sound" if job.modality == "beeping_video" else job.modality
    rel = f"{stem}_{job.index:06d}{FILE_EXTENSIONS[spec.format]}"
    if isinstance(spec, ImageSpec):
        write_image(spec, out_dir / rel)
    elif isinstance(spec, VideoSpec):
        write_video(spec, out_dir / rel)
    else:
        write_audio(spec, out_dir / rel)
    return label(job, spec, rel)


def _write_item_star(args: tuple[ItemJob, Path]) -> dict[str, Any]:
    return write_item(*args)


def generate(seed: int, out_dir: str | Path, images: int = 0, videos: int = 0, audios: int = 0, *,
             max_video_seconds: float = VIDEO_DURATION_MAX_S, image_format: str | None = None,
             video_format: str | None = None, audio_format: str | None = None,
             workers: int = 1, beeping_videos: int = 0) -> list[dict[str, Any]]:
    """Write ``images`` + ``videos`` + ``audios`` + ``beeping_videos`` items and ``labels.jsonl``
    into ``out_dir``.

    Returns the labels in file order (images, videos, audios, then beeping videos, each by index).
    """
    for name, n in (("images", images), ("videos", videos), ("audios", audios), ("beeping videos", beeping_videos)):
        if n < 0:
            raise ValueError(f"{name} count must be >= 0, got {n}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    for modality, fmt, allowed in (("image", image_format, IMAGE_FORMATS),
                                   ("video", video_format, VIDEO_FORMATS),
                                   ("audio", audio_format, AUDIO_FORMATS)):
        if fmt is not None and fmt not in allowed:
            raise ValueError(f"{modality} format must be one of {allowed}, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = ([ItemJob("image", seed, i, image_format, max_video_seconds) for i in range(images)]
            + [ItemJob("video", seed, i, video_format, max_video_seconds) for i in range(videos)]
            + [ItemJob("audio", seed, i, audio_format, max_video_seconds) for i in range(audios)]
            + [ItemJob("beeping_video", seed, i, video_format, max_video_seconds) for i in range(beeping_videos)])
    if workers == 1:
        labels = [write_item(job, out) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            labels = list(pool.map(_write_item_star, [(job, out) for job in jobs]))
    with open(out / LABELS_FILE, "w", encoding="utf-8") as f:
        for record in labels:
            f.write(json.dumps(record) + "\n")
    return labels


def read_labels(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``labels.jsonl`` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / LABELS_FILE
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate synthetic caption-task media (issue F).")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--images", type=int, default=0)
    parser.add_argument("--videos", type=int, default=0)
    parser.add_argument("--audios", type=int, default=0)
    parser.add_argument("--beeping-videos", type=int, default=0, help="videos with a sound track of beeps")
    parser.add_argument("--max-video-seconds", type=float, default=VIDEO_DURATION_MAX_S,
                        help="cap on video duration (>= 2); default 60 as in the spec")
    parser.add_argument("--image-format", choices=IMAGE_FORMATS, default=None)
    parser.add_argument("--video-format", choices=VIDEO_FORMATS, default=None)
    parser.add_argument("--audio-format", choices=AUDIO_FORMATS, default=None)
    parser.add_argument("--workers", type=int, default=1, help="processes writing items")
    args = parser.parse_args(argv)
    labels = generate(args.seed, args.out, args.images, args.videos, args.audios,
                      max_video_seconds=args.max_video_seconds, image_format=args.image_format,
                      video_format=args.video_format, audio_format=args.audio_format,
                      workers=args.workers, beeping_videos=args.beeping_videos)
    print(f"wrote {len(labels)} items and {LABELS_FILE} to {args.out}")


if __name__ == "__main__":
    main()
