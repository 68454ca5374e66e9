"""UnitProducer: make the encoder inputs of claimed units and hand them to the batcher.

    claimed units ─► cache re-check ─► image / audio: decode + preprocess (or reuse the planning's)
                                   └─► video: chunks of frame groups (video_chunks), each decoded
                                       from its own seek point on the worker pool, concurrently;
                                       its sound's segments as audio, alongside
                   ─► batcher.submit(EncoderJob) per unit; any failure ─► batcher.fail for the rest

It also owns the decode helpers planning needs when the cache has no manifest (image/audio decode,
video probe), so every decode of the runtime is counted in one place. Blocking work runs on the
worker pool; the coroutines run on the event loop.

The inputs a production decodes stay counted in the decode budget until the encoder is done with
them: each decode moves the bytes of its patch rows / log-mels out of its reservation
(``_hand_on``) into the production's ``HeldInputs``, ``_submit`` gives each unit's share to its
``EncoderJob`` (the batcher releases it after the forward), and whatever no job took (a failure,
a cancelled production, a repeated unit) is released when the production ends. So a decode waits
for the encoder to catch up instead of queueing rows beyond ``max_decoded_bytes_in_flight``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

import torch

from mm_pipeline.media.decode.audio import decode_audio, header_seconds
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeCancelled, DecodeControl, check
from mm_pipeline.media.decode.backend import DecodeBackend, ThreadDecodeBackend
from mm_pipeline.media.decode.image import (AnimationInfo, animation_decode_bytes, decode_image_peak, probe_animation,
                                            probe_image)
from mm_pipeline.media.decode.decoder_memory import frame_decode_bytes
from mm_pipeline.media.decode.video import VideoInfo, probe_video
from mm_pipeline.media.decode.early_audio import early_audio_of
from mm_pipeline.encode.batcher import EncoderBatcher, EncoderJob
from mm_pipeline.encode.decode_peaks import audio_bytes, preprocess_image_bytes, video_chunk_bytes
from mm_pipeline.encode.held_inputs import HeldInputs, hand_on
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import MediaPlan, PlannerConfig, UnitPlan
from mm_pipeline.errors import MediaError, UnsupportedMediaType
from mm_pipeline.media.audio_codes import CODES_FORMAT, AudioCodes
from mm_pipeline.media.types import MediaItem, MediaKind
from mm_pipeline.encode.preprocess import Preprocessor, VisionInput
from mm_pipeline.media.decode.video_chunks import VideoContainers, chunks_for_early, decode_chunk_early, plan_chunks
from mm_pipeline.media.decode.video_sampling import sample_frames
from mm_pipeline.media.worker_pool import WorkerPool

_ANIMATIONS = ("gif", "webp")


class UnitProducer:
    def __init__(self, pre: Preprocessor, pool: WorkerPool, batcher: EncoderBatcher, cache: EncoderCache,
                 config: PlannerConfig, count: Callable[..., None], decoder: DecodeBackend | None = None) -> None:
        self.pre = pre
        self.decoder = decoder or ThreadDecodeBackend()  # where pixels are decoded (media/decode/backend.py)
        self.pool = pool
        self.batcher = batcher
        self.cache = cache
        self.config = config
        self._count = count
        self._tasks: set[asyncio.Task[None]] = set()
        # every decode of the runtime holds its estimated bytes here while it runs
        self.budget = DecodeBudget(config.limits.max_decoded_bytes_in_flight)
        self.on_decode_span: Callable[[float, float], None] | None = None  # (start, end): a stage timeline

    def control(self, item: MediaItem, wanted: Callable[[], bool] | None = None) -> DecodeControl:
        """The deadline (``decode_timeout_s``) and cancellation of one item's decode work."""
        return DecodeControl(self.config.limits.decode_timeout_s, wanted, what=f"{item.kind.value} from {item.origin}")

    # ---- decode helpers (worker threads) ----------------------------------------------------
    def image_input(self, item: MediaItem, control: DecodeControl | None = None,
                    held: HeldInputs | None = None) -> VisionInput:
        """The image's patch rows; with ``held``, their bytes stay counted there (unit 0)."""
        h, w = probe_image(item, self.config.limits)
        size = self.pre.image_size(h, w)
        with self.budget.reserve(self.image_bytes(h, w, size), control, "the image") as reservation:
            check(control)
            self._count("images_decoded")
            image = self.decoder.decode_image(item, self.config.limits, target=size)
            vis = self.pre.image(image, size)
            if held is not None:
                hand_on(reservation, [(0, vis.rows)], held)
            return vis

    def image_bytes(self, h: int, w: int, size: tuple[int, int]) -> int:
        """Peak bytes of ``image_input`` for an (h, w) image resized to ``size``: the decode
        (``decode_image_peak``), then -- the decoder's objects freed -- the preprocessor's float
        tensors beside the uint8 pixels (``preprocess_image_bytes``)."""
        peak, pixels = decode_image_peak(h, w, size)
        return max(peak, preprocess_image_bytes(pixels, size, self.pre.image_config, same_size=(h, w) == tuple(size)))

    def audio_inputs(self, item: MediaItem, control: DecodeControl | None = None,
                     held: HeldInputs | None = None, first: int = 0) -> list[torch.Tensor]:
        """Segments of an audio item: log-mels, or the codes of pre-tokenized audio (no decode).
        With ``held``, the log-mels' bytes stay counted there (units ``first``, ``first + 1``...)."""
        cfg = self.pre.audio_config
        if cfg is None:
            raise UnsupportedMediaType("this model has no audio encoder; audio input is not supported")
        if item.format == CODES_FORMAT:
            return self.pre.code_segments(AudioCodes.from_bytes(item.data))  # checked when loaded
        limit = self.context_samples()
        cap = int(self.config.limits.max_duration_s * cfg.sampling_rate)
        cap = cap if limit is None else min(cap, limit + 1)
        claimed = header_seconds(item)
        expected = cap if claimed is None else min(cap, int(claimed * cfg.sampling_rate) + 1)
        # decoded while the bytes arrived (an audio item, or a video's sound track: media.decode.early):
        # its samples, held in the budget already, count toward this reservation; None: decode the
        # whole bytes as before
        early = early_audio_of(item)
        try:
            audio = early.result(item, claimed, control) if early is not None else None
            kept = early.held if early is not None and audio is not None else 0
            # the decode and the log-mel (audio_bytes): an estimate from the header; whatever the
            # header says, the decode itself stops at ``cap`` samples
            with self.budget.reserve(max(0, audio_bytes(expected, cfg) - kept), control, "the audio") as reservation:
                self._count("audio_decoded")
                if audio is None:
                    audio = decode_audio(item, cfg.sampling_rate, self.config.limits, control, limit)
                else:
                    self._count("early_audio_used" if item.kind is MediaKind.AUDIO else "early_sound_used")
                mels = self.pre.audio_segments(audio)
                if held is not None:
                    hand_on(reservation, enumerate(mels, first), held)
                return mels
        finally:
            if early is not None:
                early.cancel()  # its samples were used (or not needed): give their bytes back

    def context_samples(self) -> int | None:
        """The most audio samples whose tokens fit the model's context (None: no context given)."""
        cfg, most = self.pre.audio_config, self.config.max_context_tokens
        if cfg is None or most is None:
            return None
        lo, hi = 0, int(self.config.limits.max_duration_s * cfg.sampling_rate) + 1
        while lo < hi:  # largest s with tokens(s) <= most; tokens grow with s
            mid = (lo + hi + 1) // 2
            if sum(self.pre.unit_tokens("audio", (cfg.num_mel_frames(mid),))) <= most:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def probe_video(self, item: MediaItem, control: DecodeControl | None = None
                    ) -> tuple[VideoInfo | AnimationInfo, Any, tuple[int, int]]:
        """(probe info: a VideoInfo, or an AnimationInfo for a GIF/WebP; FrameSampling; resized
        frame size) -- a demux pass (a walk over an animation's frames), no decoding."""
        self._count("probes")
        if item.format in _ANIMATIONS:
            info = probe_animation(item, self.config.limits, control)
            total, fps, h, w = info.num_frames, info.fps, info.height, info.width
        else:
            info = probe_video(item, self.config.limits, control)
            total, fps, h, w = info.total_frames, info.video_fps, info.height, info.width
        sampling = sample_frames(total, fps, self.config.video_sampling)
        return info, sampling, self.pre.video_size(h, w, sampling.num_frames)

    def lookup(self, units: Sequence[UnitPlan], count: bool = True) -> dict[str, torch.Tensor]:
        """Rows of the units the encoder cache holds (right size only), by key, on the encoder's
        device (a worker thread's copy: ``Preprocessor.cached_rows``). ``count``: the planning
        lookup, counted in the cache's hits / misses and ``unit_hits``; off: the re-check before
        producing (``_produce``), whose finds are ``unit_hits_at_claim`` (planner.py, "Counting
        lookups")."""
        found: dict[str, torch.Tensor] = {}
        looked: set[str] = set()
        for unit in units:
            if unit.key in looked:  # a unit repeated in one item is one lookup
                continue
            looked.add(unit.key)
            rows = self.cache.get(unit.key, count_hit=count, count_miss=count)
            if rows is not None and rows.shape[0] == unit.num_tokens:
                found[unit.key] = self.pre.cached_rows(rows)
                self._count("unit_hits" if count else "unit_hits_at_claim")
        return found

    # ---- production (event loop) ------------------------------------------------------------
    def start(self, plan: MediaPlan, claimed: list[int]) -> None:
        """Produce the ``claimed`` units of ``plan`` in a background task."""
        task = asyncio.get_running_loop().create_task(self._produce(plan, claimed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, plan: MediaPlan, claimed: list[int]) -> None:
        open_keys = {plan.units[i].key for i in claimed}
        keys = tuple(open_keys)
        again: set[str] = set()  # keys to produce once more (see the except clause)
        held = HeldInputs()  # the decode budget's share of the inputs decoded here, until submitted
        # a worker stops at its next frame once no request wants these units (or at the deadline)
        control = self.control(plan.item, wanted=lambda: any(self.batcher.wanted(k) for k in keys))
        try:
            # A unit may have been encoded (cached, then delivered) between this request's cache
            # lookup and its claim: look once more before decoding anything. Not counted: the
            # planning lookup counted these units already (a miss then, like a join in flight)
            found = await self.pool.run(self.lookup, [plan.units[i] for i in claimed], False)
            for key, rows in found.items():
                self.batcher.complete(key, rows)
                open_keys.discard(key)
            claimed = [i for i in claimed if plan.units[i].key in open_keys]
            if not claimed:
                return
            if plan.kind is MediaKind.VIDEO:
                sound = [i for i in claimed if plan.is_audio_unit(i)]
                frames = [i for i in claimed if not plan.is_audio_unit(i)]
                async with asyncio.TaskGroup() as group:  # the sound's segments alongside the frames
                    if sound:
                        group.create_task(self._produce_sound(plan, sound, open_keys, control, held))
                    if frames:
                        group.create_task(self._produce_video(plan, frames, open_keys, control, held))
            else:
                if not all(i in plan.inputs for i in claimed):  # planned from metadata: decode now
                    plan.inputs = await self.pool.run(self._decode_inputs, plan.item, control, held)
                for i in claimed:
                    self._submit(plan, i, plan.inputs[i], open_keys, held)
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup):  # from the task groups: report the first
                exc = exc.exceptions[0]
            error = exc if isinstance(exc, Exception) else MediaError("media production was cancelled")
            if isinstance(exc, DecodeCancelled):
                # stopped because nobody wanted these units, but a request may have joined one
                # since the worker looked (its key was still claimed): that one is produced again
                again = {k for k in open_keys if self.batcher.wanted(k)}
            for key in open_keys - again:
                self.batcher.fail(key, error)
            open_keys.clear()  # a group a decode worker hands on after this is not submitted
            if not isinstance(exc, Exception):
                raise
        finally:
            control.cancel()  # a chunk still on a worker after a failure stops at its next frame
            held.close()  # inputs no job took (a failure, a repeated unit) give their bytes back
            plan.inputs = {}
            if plan.item.early is not None:
                plan.item.early.cancel()  # its frames were taken or are not needed any more
        if again:
            self._count("productions_restarted")
            self.start(plan, [i for i in claimed if plan.units[i].key in again])

    async def _produce_sound(self, plan: MediaPlan, claimed: list[int], open_keys: set[str],
                             control: DecodeControl, held: HeldInputs) -> None:
        """A video's sound segments: the planning's mels, or the track decoded again (manifest hit)."""
        if not all(i in plan.inputs for i in claimed):
            first = len(plan.units) - plan.audio_units
            mels = await self.pool.run(self.audio_inputs, plan.item, control, held, first)
            if len(mels) != plan.audio_units:
                raise MediaError(f"the video's sound track decoded to {len(mels)} segments, planned "
                                 f"{plan.audio_units}")
            plan.inputs.update({first + k: m for k, m in enumerate(mels)})
        for i in claimed:
            self._submit(plan, i, plan.inputs[i], open_keys, held)

    async def _produce_video(self, plan: MediaPlan, claimed: list[int], open_keys: set[str],
                             control: DecodeControl, held: HeldInputs) -> None:
        if plan.video is None:  # planned from a manifest: probe again for the decode plan
            plan.video = await self.pool.run(self.probe_video, plan.item, control)
        info, sampling, size = plan.video
        tp = self.pre.image_config.temporal_patch_size
        # decoded while the bytes arrived (media.decode.early): those chunks take its frames
        video = isinstance(info, VideoInfo)
        early = plan.item.early if video else None
        if not video:  # GIF/WebP: PIL walks frames forward only, so one pass composites each once
            chunks = [list(claimed)]
        else:  # a decoder that hands groups on as they decode can take whole GOPs: nothing decoded twice
            streams = self.decoder.streams_groups and early is None
            chunks = plan_chunks(claimed, sampling.indices, info.keyframes, tp, self.config.groups_per_chunk,
                                 2 * self.config.decode_workers if streams else 0)
        from_early = chunks_for_early(early, info, sampling.indices, chunks, tp) if early is not None else set()
        # the chunks reuse each other's open containers (an H.264 open probes ~10 ms of frames), an
        # idle one holding its decoder's frames in the budget
        containers = None if not video else VideoContainers(
            plan.item, self.budget, frame_decode_bytes(info, self.config.decoder_threads),
            info.max_pixels)
        loop = asyncio.get_running_loop()

        async def one(groups: list[int], use_early: bool) -> None:
            if not any(self.batcher.wanted(plan.units[g].key) for g in groups):
                for g in groups:  # every request that wanted these went away
                    self.batcher.fail(plan.units[g].key, MediaError("no longer wanted"))
                    open_keys.discard(plan.units[g].key)
                return
            failed: list[Exception] = []

            def submit(g: int, vis: VisionInput) -> None:  # on the loop, as each group is decoded
                try:
                    self._submit(plan, g, vis, open_keys, held)
                except Exception as exc:  # raised below, once the chunk is done
                    failed.append(exc)

            # the worker's calls run on the loop before the chunk's own result is delivered
            deliver = lambda g, vis: loop.call_soon_threadsafe(submit, g, vis)  # noqa: E731
            inputs = await self.pool.run(self._video_chunk, plan.item, info, sampling.indices, groups, size, tp,
                                         control, use_early, deliver, containers, held)
            if failed:
                raise failed[0]
            for g, vis in zip(groups, inputs):
                self._submit(plan, g, vis, open_keys, held)

        try:
            # the process backend's copy of the bytes lasts for all the chunks, also those that do
            # not overlap; entering and leaving the hold copy and free nothing on the loop
            with self.decoder.hold(plan.item):
                async with asyncio.TaskGroup() as group:  # the first failure cancels the other chunks
                    for c, groups in enumerate(chunks):
                        group.create_task(one(groups, c in from_early))
        finally:
            if containers is not None:
                containers.close()
                self._count("video_containers_opened", containers.opened)
            if from_early:  # what the early decoder decoded and dropped (so far: it may still be ending)
                self._count("early_frames_decoded", early.frames_decoded)
                self._count("early_packets_skipped", early.skip.skipped)

    def _video_chunk(self, item: MediaItem, info: Any, indices: Sequence[int], groups: list[int],
                     size: tuple[int, int], tp: int, control: DecodeControl | None = None,
                     use_early: bool = False, deliver: Callable[[int, VisionInput], None] | None = None,
                     containers: VideoContainers | None = None, held: HeldInputs | None = None) -> list[VisionInput]:
        """The chunk's inputs, one per group; with ``deliver`` (not for early frames) each group
        goes to ``deliver(g, input)`` as soon as it is decoded and nothing is returned. With
        ``held``, the groups' patch rows stay counted there until their jobs are encoded."""
        t0 = time.monotonic()
        wanted = [indices[g * tp + j] for g in groups for j in range(tp)]
        peak = self.chunk_bytes(item, info, len(wanted), size, streamed=deliver is not None and not use_early,
                                repeats=len(wanted) - len(set(wanted)))
        with self.budget.reserve(peak, control, "a video chunk") as reservation:
            def ready(out: list[VisionInput], of: Sequence[int]) -> list[VisionInput]:
                if held is not None:
                    hand_on(reservation, [(g, vis.rows) for g, vis in zip(of, out)], held)
                return out

            def group_ready(g: int, frames: torch.Tensor) -> None:
                deliver(g, ready(self.pre.video_groups(frames, size), [g])[0])

            if use_early:
                frames, used = decode_chunk_early(item.early, item, info, indices, groups, tp, size, control,
                                                  threads=self.config.decoder_threads)
                self._count("early_frames_used", used)
                targets = {indices[g * tp + j] for g in groups for j in range(tp)}
                self._count("early_frames_decoded_after", len(targets) - used)
                out = ready(self.pre.video_groups(frames, size), groups)
            elif deliver is None:
                out = ready(self.pre.video_groups(self.decoder.decode_chunk(
                    item, info, indices, groups, tp, self.config.limits, size, control,
                    threads=self.config.decoder_threads, containers=containers), size), groups)
            else:
                self.decoder.decode_chunk(item, info, indices, groups, tp, self.config.limits, size, control,
                                          threads=self.config.decoder_threads, on_group=group_ready,
                                          containers=containers)
                out = []
            self._count("video_chunks_decoded")
        if self.on_decode_span is not None:
            self.on_decode_span(t0, time.monotonic())
        return out

    def chunk_bytes(self, item: MediaItem, info: Any, num_frames: int, size: tuple[int, int],
                    streamed: bool = False, repeats: int = 0) -> int:
        """Estimated peak bytes of decoding ``num_frames`` frames scaled to ``size`` and making
        their patch rows: the decoder's own source frames, and the uint8 frames beside their
        reorder and float rows (``video_chunk_bytes``; ``streamed``: groups handed on as they
        decode, ``repeats``: frames of a padded tail)."""
        out = video_chunk_bytes(num_frames, size, self.pre.image_config, streamed, repeats)
        if isinstance(info, AnimationInfo):  # PIL's compositing, on the largest canvas the frames make
            return out + animation_decode_bytes(item.format, info.height, info.width)
        return out + frame_decode_bytes(info, self.config.decoder_threads)

    def _decode_inputs(self, item: MediaItem, control: DecodeControl | None = None,
                       held: HeldInputs | None = None) -> dict[int, Any]:
        if item.kind is MediaKind.IMAGE:
            return {0: self.image_input(item, control, held)}
        return dict(enumerate(self.audio_inputs(item, control, held)))

    def _submit(self, plan: MediaPlan, i: int, inp: Any, open_keys: set[str], held: HeldInputs | None = None) -> None:
        key = plan.units[i].key
        release = held.take(i) if held is not None else None  # the budget's share of the input, if counted
        if release is None and plan.held is not None:  # an input decoded at planning
            release = plan.held.take(i)
        if key not in open_keys:
            if release is not None:
                release()
            return  # a repeated unit of this item (same key twice) was already submitted
        try:
            if not plan.is_audio_unit(i):
                job = EncoderJob(key, plan.kind.value, vision=inp, release=release,
                                 flow=plan.flow, priority=plan.priority)
            elif plan.item.format == CODES_FORMAT:
                job = EncoderJob(key, "audio", codes=inp, release=release,
                                 flow=plan.flow, priority=plan.priority)
            else:
                job = EncoderJob(key, "audio", mel=inp, release=release,
                                 flow=plan.flow, priority=plan.priority)
            self.batcher.submit(job)  # the batcher releases the job's share once it is done with it
        except BaseException:
            if release is not None:
                release()  # (a part counts once: harmless where submit released it already)
            raise
        open_keys.discard(key)
