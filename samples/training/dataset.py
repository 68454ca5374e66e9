"""Training items: synthetic media -> the server's own decode + preprocess -> tensors cached on disk.

    ItemRef(modality, seed, index, max_video_seconds)
        └─ samples.synthetic.generate.write_item   (a real encoded file: png/jpeg/webp, mp4/webm, ...)
        └─ MediaIngestor.ingest_local (sniff) ─► decode_image / probe_video+decode_range / decode_audio
        └─ Preprocessor (smart_resize, normalise, patchify / log-mel) with the demo processor_config
        └─ PromptLayout.render of the chat template ─► prompt ids + one span per encoder unit (a
           video's sound: its log-mel segments, each filling the time slices it spans)
        └─ + caption bytes + <|im_end|>  ─► TrainItem, saved as <cache>/<key>/<modality>_<seed>_<index>.pt

The video path repeats MediaPlanner's: ``sample_frames`` on the probed frame count, the resized size
from the sampled count, then frame groups of ``temporal_patch_size`` frames. Decoding is
deterministic, so an item is prepared once and every epoch only runs the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from encoders.image_processing import ImageProcessingConfig
from mm_pipeline.media.decode.audio import decode_audio, has_audio_stream
from mm_pipeline.media.decode.image import decode_image
from mm_pipeline.media.decode.video import decode_range, probe_video
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaKind, MediaSource
from samples.checkpoints.tiny_omni import tiny_special_tokens
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.prompt.layout import MediaSlots, PromptLayout
from samples.training.demo_model_config import DemoModelConfig
from samples.training.demo_tokenizer import demo_merges, demo_tokenizer
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames

DEFAULT_CACHE = Path(os.environ.get("MMSERVE_TRAIN_CACHE", Path.home() / ".cache" / "mmserve-train"))
PROMPTS = {"image": "Describe this image.", "video": "Describe this video.", "audio": "Describe this audio."}


@dataclass(frozen=True)
class ItemRef:
    """Which synthetic item: ``samples.synthetic`` item ``index`` of ``modality`` under ``seed``."""

    modality: str
    seed: int
    index: int
    max_video_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.modality not in PROMPTS and self.modality != "beeping_video":
            raise ValueError(f"modality must be one of {sorted(PROMPTS)} or beeping_video, got {self.modality!r}")


@dataclass
class TrainItem:
    """One prepared example. ``input_ids`` = prompt + answer; the loss covers
    ``input_ids[answer_start:]`` (caption bytes and <|im_end|>). ``units[k]`` fills ``spans[k]``."""

    modality: str
    caption: str
    input_ids: torch.Tensor
    answer_start: int
    units: list[torch.Tensor]                 # vision: patch rows; audio: log-mel segments
    grids: list[tuple[int, int, int]]         # vision units only
    spans: list[tuple[int, int]]
    # a video's sound track: log-mel segments, and (start, end, segment, first row) per placeholder
    # span they fill (a segment's rows are laid out over the time slices of the frame groups)
    sound: list[torch.Tensor] = field(default_factory=list)
    sound_spans: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class ItemPreparer:
    """Decode + preprocess + lay out one media file exactly as the server does."""

    def __init__(self, config: DemoModelConfig) -> None:
        self.special = tiny_special_tokens()
        self.tokenizer = demo_tokenizer()
        processor = config.processor_config(self.special)
        self.image_config = ImageProcessingConfig.from_dict(processor)
        self.sampling = VideoSamplingParams.from_processor_config(processor)
        self.audio_config = config.audio
        self.pre = Preprocessor(self.image_config, config.audio)
        self.layout = PromptLayout.from_tokenizer(self.special, self.tokenizer)
        self.limits = MediaLimits()
        self.ingestor = MediaIngestor(IngestConfig(allowed_local_dirs=("/",)))

    def prepare(self, path: str | Path, caption: str) -> TrainItem:
        item = self.ingestor.ingest_local(MediaSource(path=str(Path(path).resolve())))
        units: list[torch.Tensor] = []
        grids: list[tuple[int, int, int]] = []
        if item.kind is MediaKind.IMAGE:
            vis = self.pre.image(decode_image(item, self.limits))
            units, grids = [vis.rows], [vis.grid]
            slots = MediaSlots("image", self.pre.unit_tokens("image", vis.grid))
        elif item.kind is MediaKind.VIDEO:
            info = probe_video(item, self.limits)
            sampling = sample_frames(info.total_frames, info.video_fps, self.sampling)
            size = self.pre.video_size(info.height, info.width, sampling.num_frames)
            targets = sorted(set(sampling.indices))
            frames = decode_range(item, info, targets)
            row = {t: k for k, t in enumerate(targets)}
            groups = self.pre.video_groups(frames[[row[t] for t in sampling.indices]], size)
            units, grids = [g.rows for g in groups], [g.grid for g in groups]
            tp = self.image_config.temporal_patch_size
            sizes = self.pre.unit_tokens("video", self.pre.video_grid(size, sampling.num_frames))
            sound = (self.pre.audio_segments(decode_audio(item, self.audio_config.sampling_rate, self.limits))
                     if has_audio_stream(item) else [])  # as the server hears a video (video_audio on)
            slots = MediaSlots("video", sizes, tuple(sampling.timestamps[::tp]),
                               self.pre.unit_tokens("audio", (sum(int(m.shape[0]) for m in sound),)) if sound else (),
                               self.audio_config.tokens_per_second if sound else 0.0)
        else:
            units = self.pre.audio_segments(decode_audio(item, self.audio_config.sampling_rate, self.limits))
            slots = MediaSlots("audio", self.pre.unit_tokens("audio", (sum(int(m.shape[0]) for m in units),)))
        messages = [{"role": "user", "content": [{"type": item.kind.value},
                                                 {"type": "text", "text": PROMPTS[item.kind.value]}]}]
        laid = self.layout.render(self.tokenizer, messages, [slots])
        answer = list(self.tokenizer.encode(caption, add_special_tokens=False)) + [self.special.im_end]
        ids = torch.tensor(list(laid.token_ids) + answer, dtype=torch.long)
        spans, sound_spans = [], []
        for (start, end), (unit, row) in zip(laid.unit_spans[0], laid.pieces(0)):
            if unit < len(units):
                spans.append((start, end))
            else:
                sound_spans.append((start, end, unit - len(units), row))
        if len(spans) != len(units):
            raise RuntimeError(f"{path}: {len(units)} encoder units but {len(spans)} placeholder spans")
        return TrainItem(item.kind.value, caption, ids, len(laid.token_ids), units, grids, spans,
                         sound if item.kind is MediaKind.VIDEO else [], sound_spans)


def compact(item: TrainItem) -> TrainItem:
    """Storage form: vision rows as float16 (normalised pixels: ~3 significant digits suffice, and
    a 60 s video stays a few MB), every unit its own storage (a saved view would drag the whole
    video's rows along into each group's file)."""
    units = [u.to(torch.float16).clone() if item.modality != "audio" else u.clone() for u in item.units]
    return TrainItem(item.modality, item.caption, item.input_ids.clone(), item.answer_start, units,
                     item.grids, item.spans, [m.clone() for m in item.sound], item.sound_spans)


def cache_key(config: DemoModelConfig) -> str:
    """Digest of everything that changes a prepared item (processor + audio front end + tokenizer
    merges + layout)."""
    blob = json.dumps({"processor": config.processor_config(tiny_special_tokens()),
                       "audio": asdict(config.audio), "merges": demo_merges(), "version": 3},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_WORKER: ItemPreparer | None = None


def _prepare_ref(args: tuple[ItemRef, DemoModelConfig, str]) -> str:
    """Worker: generate the file in a temp dir, prepare it, save the tensors; returns the .pt path."""
    global _WORKER
    ref, config, out_dir = args
    out = Path(out_dir) / f"{ref.modality}_{ref.seed}_{ref.index}_{ref.max_video_seconds:g}.pt"
    if out.exists():
        return str(out)
    from samples.synthetic.generate import ItemJob, write_item

    torch.set_num_threads(1)
    if _WORKER is None:
        _WORKER = ItemPreparer(config)
    with tempfile.TemporaryDirectory() as tmp:
        label = write_item(ItemJob(ref.modality, ref.seed, ref.index, None, ref.max_video_seconds), Path(tmp))
        prepared = _WORKER.prepare(Path(tmp) / label["path"], label["caption"])
    tmp_out = out.with_suffix(".tmp")
    torch.save(asdict(compact(prepared)), tmp_out)
    tmp_out.replace(out)  # atomic: a killed run never leaves a torn item
    return str(out)


def prepare_items(refs: Sequence[ItemRef], config: DemoModelConfig, cache_dir: str | Path = DEFAULT_CACHE,
                  workers: int = 2) -> list[Path]:
    """Prepared-item paths for ``refs`` (cached ones are reused), in ``refs`` order."""
    out_dir = Path(cache_dir) / cache_key(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(r, config, str(out_dir)) for r in refs]
    if workers <= 1:
        return [Path(_prepare_ref(j)) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [Path(p) for p in pool.map(_prepare_ref, jobs, chunksize=8)]


def load_item(path: str | Path) -> TrainItem:
    """A cached item with its tensors memory-mapped from the file: the prepared set (~5 GB) then
    lives once in the page cache, shared by every data-parallel rank and reclaimable, instead of
    once per process (measured: 300 long videos, 2.0 GB resident loaded plainly, 9 MB mapped)."""
    d: dict[str, Any] = torch.load(path, weights_only=False, mmap=True)
    return TrainItem(**d)
