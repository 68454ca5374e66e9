r"""Media item -> encoder units: layout sizes first, then cache hits, joins or production.

    load(ref)    ingest (bytes, sniff); pre-tokenized audio codes: checked against the model, then an
                 audio item whose bytes are the codes' canonical bytes (media/audio_codes.py)
    plan(item)   content key (hashed at ingest, before the sniff) ─► media key ─► manifest in the cache?
                                         ─yes─► unit keys + sizes + decoded bytes: no sniff (ingest's
                                                memo), no probe, no decode at all
                                         └─no─► image: header only (decoded when produced)
                                                audio: decode (stops at the context) + preprocess
                                                       (codes: cut into the audio's segments); the
                                                       log-mels stay counted in the decode budget
                                                       until encoded or dropped (plan.held)
                                                video: probe (demux only) ─► sampling ─► sizes;
                                                       its sound track (if any, video_audio on):
                                                       decoded as audio, segments after the groups
                 sizes: encoders.config.unit_tokens of the grids / mel frames (= encoder output rows)
                 then every unit key is looked up in the cache tiers (not with layout_only: the
                 sizes alone, what /tokenize needs, read no cached rows)
    plan_warm(ref)  worker thread: load + plan in one job when the manifest is cached and nobody
                 is planning the same media (a repeat, a new question); else the usual two steps
    start(plan, sinks)  cached unit ─► its sink now (or earlier: deliver_cached)
                        unit in flight for another request ─► join it (single flight)
                        else claim it ─► a producer task: decode ─► preprocess ─► batcher.submit

Counting lookups: the encoder cache's hits / misses (units) and manifest_hits / manifest_misses
count each request's lookups once, however often its plan reads the cache:

    manifest    plan_warm's read counts its hit; its miss is not counted, the planning pass
                (_plan_sync) reads again and that read counts, hit or miss
    units       the planning lookup (_with_cached) counts, hit or miss: X-Encoder-Cache-Hits is its
                hits. The producer's re-check before decoding (unit_producer._produce) counts
                nothing there: a unit another request cached between this request's planning and
                its claim was a miss when looked up and stays one, as a unit joined while another
                request encodes it does; the re-check's finds are the count unit_hits_at_claim

A request that joins another's planning pass (plan_joins) reads nothing itself and is not counted
again. So a cold item then its repeat move hits and misses by its units once each, and the
manifest counts as the per-kind manifest_hits / manifest_misses below do.

Concurrent plans of one media key share one planning pass and its decoded inputs (a SingleFlight,
the mechanism the batcher's unit claims use too). Plans are the types of mm_pipeline.encode.plan;
the media and unit keys and the manifest are mm_pipeline.encode.cached_layout's; production
(decode, preprocess, submit; video chunk by chunk) is mm_pipeline.encode.unit_producer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch

from mm_pipeline.encode.batcher import EncoderBatcher, UnitSink
from mm_pipeline.encode.cached_layout import CachedLayout
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.held_inputs import HeldInputs
from mm_pipeline.encode.plan import MediaPlan, PlannerConfig, UnitPlan
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.encode.single_flight import SingleFlight
from mm_pipeline.encode.unit_producer import UnitProducer
from mm_pipeline.errors import (ContextLengthError, InvalidInputError, MediaError, MediaNotFound, MediaTooLarge,
                                UndecodableMediaError, UnsupportedMediaType, echo)
from mm_pipeline.media.decode.audio import has_audio_stream
from mm_pipeline.media.decode.backend import DecodeBackend
from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import image_decode_bytes, probe_image
from mm_pipeline.media.decode.early import EarlyDecoders
from mm_pipeline.media.decode.video import VideoInfo
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.audio_codes import CODES_FORMAT, AudioCodes
from mm_pipeline.media.types import MediaItem, MediaKind, MediaSource
from mm_pipeline.media.worker_pool import WorkerPool
from mm_pipeline.prompt.messages import MediaRef

log = logging.getLogger("mmserve.media")
FileResolver = Callable[[str], "tuple[bytes | Path, str | None]"]


class MediaPlanner:
    """Turns media references into planned units and produces the units nobody has yet."""

    def __init__(self, preprocessor: Preprocessor, cache: EncoderCache, batcher: EncoderBatcher,
                 pool: WorkerPool, ingestor: MediaIngestor, encoder_id: str,
                 config: PlannerConfig = PlannerConfig(), decoder: DecodeBackend | None = None) -> None:
        self.pre = preprocessor
        self.cache = cache
        self.batcher = batcher
        self.pool = pool
        self.ingestor = ingestor
        self.config = config
        # the media's and units' keys and their manifests in the cache
        self.cached_layout = CachedLayout(cache, preprocessor.image_config, preprocessor.audio_config,
                                          config.video_sampling, encoder_id, self._hears_videos())
        self.file_resolver: FileResolver | None = None
        self.local_files = False  # the resolver's names are local paths, which media errors name (caption job)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()  # worker threads count concurrently
        self.producer = UnitProducer(preprocessor, pool, batcher, cache, config, self._count, decoder)
        # http(s) videos and audio start decoding while their bytes arrive (off: --no-decode-while-receiving),
        # what they keep counted in the producer's decode budget
        audio = preprocessor.audio_config
        ingestor.early_decode = EarlyDecoders(
            config.video_sampling, config.limits, ingestor.config.fetch_timeout_s, config.decoder_threads,
            budget=self.producer.budget, audio_rate=audio.sampling_rate if audio is not None else None,
            context_samples=self.producer.context_samples(), video_sound=self._hears_videos()).start
        # media key -> the planning pass in progress, going on while any request still wants it
        self._planning: SingleFlight[MediaPlan] = SingleFlight(lambda: MediaError("planning was cancelled"))
        # file id -> the read in progress: the choices of one request share one copy of the bytes
        self._loading: SingleFlight[MediaItem] = SingleFlight(lambda: MediaError("loading the file was cancelled"))

    # ---- public API -------------------------------------------------------------------------
    async def load(self, ref: MediaRef, salt: str | None = None) -> MediaItem:
        """Ingest one media reference (uploaded file ids through the resolver). Concurrent loads
        of one file id (the n choices of one request) read it once and share the bytes. ``salt``:
        the request's cache_salt (ingest's memos are per salt)."""
        if ref.codes is not None:
            return await self.pool.run(self._codes_item, ref.codes)
        if ref.source is not None:
            return await self.ingestor.ingest(ref.source, salt)
        if self.file_resolver is None:
            raise MediaNotFound(f"file {echo(ref.file_id)}: this server has no file store")
        key = f"{ref.file_id}\0{ref.kind.value if ref.kind is not None else ''}\0{salt or ''}"
        item, _ = await self._loading.run(key, lambda: self._load_file(ref, salt))
        return item

    def check_request(self, refs: Sequence[MediaRef]) -> None:
        """Request-level limits known before anything is read: the number of media items, and of
        each kind the parts name (--limit-mm-per-prompt; check_plans counts the sniffed kinds too)."""
        kinds = [None if r.kind is None else r.kind.value for r in refs]
        if (problem := self.config.limits.check_items(kinds)) is not None:
            raise InvalidInputError(problem)

    def check_plans(self, plans: Sequence[MediaPlan]) -> None:
        """Request-level limits known once every item is planned and before any is produced: the
        decoded bytes of the request, and media tokens alone over the model's context."""
        # the kinds as ingest found them: a part that named none (an uploaded file) counts now
        if (problem := self.config.limits.check_counts(Counter(p.kind.value for p in plans))) is not None:
            raise InvalidInputError(problem)
        limit = self.config.limits.max_request_decoded_bytes
        total = sum(p.decoded_bytes for p in plans)
        if total > limit:
            raise MediaTooLarge(f"the request's media decode to about {total >> 20} MiB, limit {limit >> 20} MiB "
                                f"(max_request_decoded_bytes)")
        context, tokens = self.config.max_context_tokens, sum(p.num_tokens for p in plans)
        if context is not None and tokens >= context:
            raise ContextLengthError(f"the request's media take {tokens} tokens, over the context limit of "
                                     f"{context} tokens")

    def plan_warm(self, ref: MediaRef, salt: str | None = None, *, layout_only: bool = False
                  ) -> tuple[MediaItem | None, MediaPlan | None]:
        """Worker thread: load and plan in one hop off the event loop (runtime/chat_preparation.py). A
        source ``ingest_local`` takes (upload bytes, data URL, local file) is ingested; when the
        cache holds the item's manifest and no other request is planning the same media now, it
        is planned from that manifest too, exactly as ``plan`` would (a repeat, a new question
        about the same media). ``(item, plan)``; plan None: ``plan(item)`` plans it as usual (a
        manifest miss opens the media, and concurrent cold plans share one pass there -- the
        manifest is then read a second time, a dict lookup in the memory tier, and that read is
        the one the cache counts: this one counts only a hit); (None, None): a
        source only ``load`` takes (http(s), an uploaded file id, audio codes). ``layout_only``: as
        ``plan`` takes it."""
        if ref.source is None or not self.ingestor.ingests_locally(ref.source):
            return None, None
        item = self.ingestor.ingest_local(ref.source, salt)
        self._check_kind(item)
        if self._encoder_of(item) is None or item.content_key is None:
            return item, None  # plan() says why, or hashes the bytes
        mkey = self.cached_layout.media_key(item.content_key, item.kind, salt)
        if mkey in self._planning:
            return item, None  # join that pass (it may be decoding: its inputs are shared)
        plan = self.cached_layout.read(item, mkey, count_miss=False)  # the planning pass counts a miss
        if plan is None:
            return item, None
        self._count(f"manifest_hits.{item.kind.value}")
        self._count(f"plans_one_hop.{item.kind.value}")
        return item, self._with_cached(plan, layout_only)

    async def plan(self, item: MediaItem, salt: str | None = None, *, layout_only: bool = False) -> MediaPlan:
        """Unit keys and sizes of ``item`` (decoding only when neither the cache nor metadata
        can give the sizes) plus the units the cache already holds. ``salt``: the request's
        cache_salt (content_hash.salted_media_key), for ``plan_warm`` too. ``layout_only``: a plan
        to size the prompt, never started (/tokenize): the cache's rows are not read (``cached``
        stays empty; a plan started anyway finds them when its units are claimed)."""
        self._check_kind(item)
        if self._encoder_of(item) is None:
            raise UnsupportedMediaType(f"this model has no encoder for {item.kind.value} input")
        content = item.content_key or await self.pool.run(content_key, item.data)  # ingest hashed it already
        mkey = self.cached_layout.media_key(content, item.kind, salt)
        control = self.producer.control(item)
        # every request that wanted this plan ended: its worker stops at the next frame
        plan, planned_here = await self._planning.run(
            mkey, lambda: self.pool.run(self._plan_sync, item, mkey, control, layout_only), abandon=control.cancel)
        if planned_here:
            return plan
        # another request planned the same media meanwhile: share its layout and its preprocessed
        # inputs instead of decoding a second time (its cache hits were handed to its own sinks;
        # this plan's units find them again when claimed, unit_producer looks before decoding)
        self._count("plan_joins")
        return MediaPlan(item, mkey, plan.units, plan.timestamps, inputs=plan.inputs, held=plan.held,
                         video=plan.video, decoded_bytes=plan.decoded_bytes, audio_units=plan.audio_units,
                         audio_per_second=plan.audio_per_second)

    def deliver_cached(self, plan: MediaPlan, sinks: Sequence[UnitSink]) -> None:
        """Hand the units the cache held at planning to their sinks now (``start`` does it too;
        called first, the rows are in the stream before the request reaches the engine)."""
        if len(sinks) != len(plan.units):
            raise ValueError(f"{len(sinks)} sinks for {len(plan.units)} units")
        for i, rows in plan.cached.items():
            sinks[i](rows, None)
        plan.delivered.update(plan.cached)
        plan.cached.clear()  # the sinks own the rows now

    def start(self, plan: MediaPlan, sinks: Sequence[UnitSink]) -> None:
        """Deliver cached units, join units in flight, claim and produce the rest (async task)."""
        self.deliver_cached(plan, sinks)
        claimed = [i for i, (unit, sink) in enumerate(zip(plan.units, sinks))
                   if i not in plan.delivered and self.batcher.attach(unit.key, sink)]
        if claimed:
            self.producer.start(plan, claimed)
        elif plan.item.early is not None:
            plan.item.early.cancel()  # the cache had every unit: stop decoding the arriving copy

    def detach(self, plan: MediaPlan, sinks: Sequence[UnitSink]) -> None:
        for unit, sink in zip(plan.units, sinks):
            self.batcher.detach(unit.key, sink)

    @property
    def counts(self) -> dict[str, int]:
        """Work done: probes, images_decoded, audio_decoded, audio_codes (pre-tokenized items
        loaded), video_chunks_decoded, video_containers_opened (the chunks of a video share open containers:
        media.decode.video_chunks.VideoContainers), unit_hits (units found in the encoder cache), plan_joins,
        unit_hits_at_claim (units another request cached between a request's planning and its claim,
        found by the producer's re-check), productions_restarted (units dropped as unwanted just as a
        request joined them, produced again);
        per modality (``name.kind``) manifest_hits and manifest_misses, and the ingestor's
        content_hashes, sniff_probes, sniff_memo_hits, early_decodes; plans_one_hop (planned from the
        manifest in ``plan_warm``, in the hop that ingested them); early_frames_used /
        early_frames_decoded_after: sampled frames of chunks an early decode served
        (media.decode.early), kept by it / decoded after arrival; early_frames_decoded /
        early_packets_skipped: frames that early decode decoded / packets it dropped undecoded
        (the tails of keyframe spans, early_packets.KeyframeSkip); early_audio_used: audio items
        whose samples came from an early decode (media.decode.early_audio); early_sound_used: videos
        whose sound track's samples did."""
        with self._counts_lock:
            return {**self.ingestor.counts, **self._counts}

    def _check_kind(self, item: MediaItem) -> None:
        """A kind --limit-mm-per-prompt disables, found only by ingest (a ``file`` part names none):
        refused as soon as the bytes are sniffed, before any planning, decode or cache write."""
        if not self.config.limits.allows(item.kind.value):
            raise InvalidInputError(self.config.limits.check_counts({item.kind.value: 1}))

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    # ---- planning (worker thread) -----------------------------------------------------------
    async def _load_file(self, ref: MediaRef, salt: str | None = None) -> MediaItem:
        try:
            data, name = await self.pool.run(self.file_resolver, ref.file_id)
        except KeyError:
            raise MediaNotFound(f"no uploaded file with id {echo(ref.file_id)}") from None
        if isinstance(data, Path):
            data = await self.pool.run(self._read_upload, data, ref.file_id)
        origin = f"local file {name!r}" if self.local_files and name else None  # None: "upload"
        return await self.ingestor.ingest(MediaSource(data=data if isinstance(data, bytes) else bytes(data),
                                                      kind=ref.kind, origin=origin), salt)

    def _codes_item(self, codes: AudioCodes) -> MediaItem:
        """Pre-tokenized audio as an audio item: checked against the model (every time: a
        manifest hit must not skip it), its bytes the codes' canonical bytes, hashed here."""
        self.pre.check_codes(codes, self.config.limits.max_duration_s)
        self._count("audio_codes")
        data = codes.to_bytes()
        return MediaItem(MediaKind.AUDIO, CODES_FORMAT, data, origin="audio codes", content_key=content_key(data))

    def _read_upload(self, path: Path, file_id: str) -> bytes:
        # the media cap before the read: an upload may be larger than media may be. Opened once and
        # sized through the open file: a DELETE /v1/files between the id's lookup and here is the
        # same 404 as an id deleted earlier, not an error of the server
        limit = self.config.limits.max_bytes
        try:
            f = path.open("rb")
        except FileNotFoundError:
            raise MediaNotFound(f"no uploaded file with id {echo(file_id)}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise MediaTooLarge(f"uploaded file {file_id!r} is {size} bytes, over the {limit}-byte media limit "
                                    f"(max_bytes)")
            return f.read(limit + 1)

    def _encoder_of(self, item: MediaItem):
        return self.batcher.audio if item.kind is MediaKind.AUDIO else self.batcher.vision

    def _with_cached(self, plan: MediaPlan, layout_only: bool) -> MediaPlan:
        """``plan`` with the rows of its units the cache holds now; ``layout_only``: as it is (the
        rows of a long video are megabytes to read and deserialize, for a count)."""
        if layout_only:
            return plan
        found = self.producer.lookup(plan.units)
        plan.cached.update({i: found[u.key] for i, u in enumerate(plan.units) if u.key in found})
        return plan

    def _plan_sync(self, item: MediaItem, mkey: str, control: DecodeControl | None = None,
                   layout_only: bool = False) -> MediaPlan:
        plan = self.cached_layout.read(item, mkey)
        if plan is not None:
            self._count(f"manifest_hits.{item.kind.value}")
        else:
            self._count(f"manifest_misses.{item.kind.value}")
            plan = self._plan_from_media(item, mkey, control)
            self.cached_layout.write(plan)
        return self._with_cached(plan, layout_only)

    def _plan_from_media(self, item: MediaItem, mkey: str, control: DecodeControl | None) -> MediaPlan:
        if item.kind is MediaKind.IMAGE:
            # sizes from the header; the pixels are decoded when the unit is produced, after the
            # request-level budgets (check_plans) passed
            h, w = probe_image(item, self.config.limits)
            size = self.pre.image_size(h, w)
            grid = (1, size[0] // self.pre.image_config.patch_size, size[1] // self.pre.image_config.patch_size)
            (tokens,) = self.pre.unit_tokens("image", grid)
            return MediaPlan(item, mkey, (UnitPlan(mkey, tokens),), decoded_bytes=image_decode_bytes(h, w))
        if item.kind is MediaKind.AUDIO:
            # log-mels (counted in the decode budget until encoded or dropped), or codes (the same segments)
            held = HeldInputs(until_dropped=True)
            mels = self.producer.audio_inputs(item, control, held)
            rule = "audio_codes" if item.format == CODES_FORMAT else "audio"
            sizes = self.pre.unit_tokens(rule, (sum(int(m.shape[0]) for m in mels),))
            if len(sizes) != len(mels):
                raise AssertionError(f"{len(mels)} mel segments but the token rule cuts {len(sizes)}")
            keys = self.cached_layout
            units = tuple(UnitPlan(keys.unit_key(item.kind, mkey, i), n) for i, n in enumerate(sizes))
            return MediaPlan(item, mkey, units, inputs=dict(enumerate(mels)), held=held,
                             decoded_bytes=sum(m.numel() * m.element_size() for m in mels))
        if item.kind is MediaKind.VIDEO:
            return self._plan_video(item, mkey, control)
        raise UnsupportedMediaType(f"media kind {item.kind} is not supported")

    def _plan_video(self, item: MediaItem, mkey: str, control: DecodeControl | None) -> MediaPlan:
        info, sampling, size = self.producer.probe_video(item, control)
        sizes = self.pre.unit_tokens("video", self.pre.video_grid(size, sampling.num_frames))
        keys = self.cached_layout
        units = tuple(UnitPlan(keys.unit_key(item.kind, mkey, g), n) for g, n in enumerate(sizes))
        stamps = sampling.timestamps[::self.pre.image_config.temporal_patch_size]  # a group's first frame
        plan = MediaPlan(item, mkey, units, tuple(stamps), video=(info, sampling, size),
                         decoded_bytes=self.producer.chunk_bytes(item, info, sampling.num_frames, size))
        held = HeldInputs(until_dropped=True)
        mels = self._sound_of(item, control, held, len(units)) if self._hears_videos() and isinstance(info, VideoInfo) else []
        if mels:
            plan.held = held
            sizes = self.pre.unit_tokens("audio", (sum(int(m.shape[0]) for m in mels),))
            plan.units += tuple(UnitPlan(keys.sound_key(mkey, i), n) for i, n in enumerate(sizes))
            plan.inputs.update({len(units) + i: m for i, m in enumerate(mels)})
            plan.audio_units, plan.audio_per_second = len(mels), self._sound_rate()
            plan.decoded_bytes += sum(m.numel() * m.element_size() for m in mels)
        return plan

    # ---- a video's sound track ---------------------------------------------------------------
    def _hears_videos(self) -> bool:
        return self.config.video_audio and self.batcher.audio is not None and self.pre.audio_config is not None

    def _sound_of(self, item: MediaItem, control: DecodeControl | None, held: HeldInputs, first: int
                  ) -> list[torch.Tensor]:
        """Log-mel segments of a video's sound track (units ``first``...: their bytes held in
        ``held``); [] when it has none. A sound track that does not decode leaves the video without
        sound (its frames are still served, the count ``video_sound_dropped`` says so); the duration
        and context limits apply as to audio."""
        if not has_audio_stream(item):
            return []
        try:
            return self.producer.audio_inputs(item, control, held, first)
        except UndecodableMediaError as exc:
            self._count("video_sound_dropped")
            log.warning("video from %s: its sound track does not decode, serving the frames alone (%s)",
                        item.origin, exc)
            return []

    def _sound_rate(self) -> float:
        assert self.pre.audio_config is not None
        return self.pre.audio_config.tokens_per_second
