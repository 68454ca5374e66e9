"""UnitProducer: make the encoder inputs of claimed units and hand them to the batcher.

    claimed units ─► cache re-check ─► image / audio: decode + preprocess (or reuse the planning's)
                                   └─► video: chunks of frame groups (video_chunks), each decoded
                                       from its own seek point on the worker pool, concurrently
                   ─► batcher.submit(EncoderJob) per unit; any failure ─► batcher.fail for the rest

It also owns the decode helpers planning needs when the cache has no manifest (image/audio decode,
video probe), so every decode of the runtime is counted in one place. Blocking work runs on the
worker pool; the coroutines run on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch

from mm_pipeline.media.decode_audio import decode_audio
from mm_pipeline.media.decode_image import decode_image, probe_animation
from mm_pipeline.media.decode_video import probe_video
from mm_pipeline.encode.batcher import EncoderBatcher, EncoderJob
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import MediaPlan, PlannerConfig, UnitPlan
from mm_pipeline.errors import MediaError, UnsupportedMediaType
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.encode.preprocess import Preprocessor, VisionInput
from mm_pipeline.media.video_chunks import decode_chunk, plan_chunks
from mm_pipeline.media.video_sampling import sample_frames
from mm_pipeline.media.worker_pool import WorkerPool

_ANIMATIONS = ("gif", "webp")


class UnitProducer:
    def __init__(self, pre: Preprocessor, pool: WorkerPool, batcher: EncoderBatcher, cache: EncoderCache,
                 config: PlannerConfig, count: Callable[[str], None]) -> None:
        self.pre = pre
        self.pool = pool
        self.batcher = batcher
        self.cache = cache
        self.config = config
        self._count = count
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- decode helpers (worker threads) ----------------------------------------------------
    def image_input(self, item: MediaItem) -> VisionInput:
        self._count("images_decoded")
        return self.pre.image(decode_image(item, self.config.limits))

    def audio_inputs(self, item: MediaItem) -> list[torch.Tensor]:
        cfg = self.pre.audio_config
        if cfg is None:
            raise UnsupportedMediaType("this model has no audio encoder; audio input is not supported")
        self._count("audio_decoded")
        return self.pre.audio_segments(decode_audio(item, cfg.sampling_rate, self.config.limits))

    def probe_video(self, item: MediaItem) -> tuple[Any, Any, tuple[int, int]]:
        """(probe info or None for a GIF/WebP, FrameSampling, resized frame size) -- a demux pass,
        no decoding."""
        self._count("probes")
        if item.format in _ANIMATIONS:
            anim = probe_animation(item, self.config.limits)
            info, total, fps, h, w = None, anim.num_frames, anim.fps, anim.height, anim.width
        else:
            info = probe_video(item, self.config.limits)
            total, fps, h, w = info.total_frames, info.video_fps, info.height, info.width
        sampling = sample_frames(total, fps, self.config.video_sampling)
        return info, sampling, self.pre.video_size(h, w, sampling.num_frames)

    def lookup(self, units: Sequence[UnitPlan]) -> dict[str, torch.Tensor]:
        """Rows of the units the encoder cache holds (right size only), by key."""
        found: dict[str, torch.Tensor] = {}
        for unit in units:
            if unit.key in found:
                continue
            rows = self.cache.get(unit.key)
            if rows is not None and rows.shape[0] == unit.num_tokens:
                found[unit.key] = rows
                self._count("unit_hits")
        return found

    # ---- production (event loop) ------------------------------------------------------------
    def start(self, plan: MediaPlan, claimed: list[int]) -> None:
        """Produce the ``claimed`` units of ``plan`` in a background task."""
        task = asyncio.get_running_loop().create_task(self._produce(plan, claimed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, plan: MediaPlan, claimed: list[int]) -> None:
        open_keys = {plan.units[i].key for i in claimed}
        try:
            # A unit may have been encoded (cached, then delivered) between this request's cache
            # lookup and its claim: look once more before decoding anything.
            found = await self.pool.run(self.lookup, [plan.units[i] for i in claimed])
            for key, rows in found.items():
                self.batcher.complete(key, rows)
                open_keys.discard(key)
            claimed = [i for i in claimed if plan.units[i].key in open_keys]
            if not claimed:
                return
            if plan.kind is MediaKind.VIDEO:
                await self._produce_video(plan, claimed, open_keys)
            else:
                if not all(i in plan.inputs for i in claimed):  # planned from a manifest: decode now
                    plan.inputs = await self.pool.run(self._decode_inputs, plan.item)
                for i in claimed:
                    self._submit(plan, i, plan.inputs[i], open_keys)
        except BaseException as exc:
            if isinstance(exc, BaseExceptionGroup):  # from the chunk task group: report the first
                exc = exc.exceptions[0]
            error = exc if isinstance(exc, Exception) else MediaError("media production was cancelled")
            for key in open_keys:
                self.batcher.fail(key, error)
            if not isinstance(exc, Exception):
                raise
        finally:
            plan.inputs = {}

    async def _produce_video(self, plan: MediaPlan, claimed: list[int], open_keys: set[str]) -> None:
        if plan.video is None:  # planned from a manifest: probe again for the decode plan
            plan.video = await self.pool.run(self.probe_video, plan.item)
        info, sampling, size = plan.video
        tp = self.pre.image_config.temporal_patch_size
        keyframes = info.keyframes if info is not None else (0,)
        chunks = plan_chunks(claimed, sampling.indices, keyframes, tp, self.config.groups_per_chunk)

        async def one(groups: list[int]) -> None:
            if not any(self.batcher.wanted(plan.units[g].key) for g in groups):
                for g in groups:  # every request that wanted these went away
                    self.batcher.fail(plan.units[g].key, MediaError("no longer wanted"))
                    open_keys.discard(plan.units[g].key)
                return
            inputs = await self.pool.run(self._video_chunk, plan.item, info, sampling.indices, groups, size, tp)
            for g, vis in zip(groups, inputs):
                self._submit(plan, g, vis, open_keys)

        async with asyncio.TaskGroup() as group:  # the first failure cancels the other chunks
            for c in chunks:
                group.create_task(one(c))

    def _video_chunk(self, item: MediaItem, info: Any, indices: Sequence[int], groups: list[int],
                     size: tuple[int, int], tp: int) -> list[VisionInput]:
        frames = decode_chunk(item, info, indices, groups, tp, self.config.limits)
        self._count("video_chunks_decoded")
        return self.pre.video_groups(frames, size)

    def _decode_inputs(self, item: MediaItem) -> dict[int, Any]:
        if item.kind is MediaKind.IMAGE:
            return {0: self.image_input(item)}
        return dict(enumerate(self.audio_inputs(item)))

    def _submit(self, plan: MediaPlan, i: int, inp: Any, open_keys: set[str]) -> None:
        key = plan.units[i].key
        if key not in open_keys:
            return  # a repeated unit of this item (same key twice) was already submitted
        kind = plan.kind.value
        job = EncoderJob(key, kind, mel=inp) if plan.kind is MediaKind.AUDIO else EncoderJob(key, kind, vision=inp)
        self.batcher.submit(job)
        open_keys.discard(key)
