r"""Decode a video while its bytes still arrive (issue 16 item 4; README "Decoding while bytes arrive").

    bytes ─► ArrivingBytes ─► early decoder thread: demux + decode front to back, keep the frames
                   │          sampling will probably pick (decoded YUV, converted later)
                   └─► finish: content key ─► sniff ─► plan (the exact demux on the whole bytes)
                                                   ─► chunks: kept frames, misses decoded as before

Which frames the model sees depends on the exact frame count (``video_sampling``), so the early
decoder needs it up front: exactly from an MP4 sample table (``moov`` before ``mdat``); from the
Segment duration of Matroska/WebM; from a fragmented MP4's ``mehd`` or leading multi-reference
``sidx`` (``sniff.fragments_duration``) -- the last two as duration x frame rate, kept for a few
counts around it. It keeps the frames of that sampling; production takes a kept frame by its pts
and decodes the targets not kept (``video_chunks.chunks_for_early``, ``decode_chunk_early``), so
the frames are the whole-bytes path's whatever the prediction was (a wrong one costs time, never
correctness; the decoder stops past the last frame the prediction keeps).
Like ``decode_range`` it skips the unkept frames no other frame is predicted from (``skips_nonref``;
which are kept is known by presentation rank among the pts demuxed so far, ``PresentationRanks``,
or by pts once production said which it wants, ``retarget``) and, while frames come in order, the
tail of a keyframe span after its last kept frame (``KeyframeSkip``, early_packets.py).

A fragmented MP4 that states no duration (FFmpeg's own fragmented forms) or an Ogg stream gives no
frame count up front (an estimate from Content-Length was measured to move most sampled frames:
docs/pipeline_measurements.md), so they are decoded after arrival, as is an MP4 with its index at
the end unless that index was fetched first (media.index_from_end): no thread is started for them.
Audio items are decoded early by ``early_audio``; ``EarlyDecoders`` starts either.

A video's sound track (when the model hears videos) is decoded by an ``EarlyAudioDecode`` on a
reader of its own over the same bytes (``EarlyVideoDecode.sound``): in the frames' demux loop it
would wait behind the frame decode, which lags the arrival (measured: docs/pipeline_measurements.md;
the second demux costs ~17 ms of CPU). It reads seekable without the declared size (with it a
fragmented MP4's demuxer looks for an index at the end); its samples are ``decode_audio``'s on the
whole bytes (tests), taken by the planner as an audio item's (``early_audio.early_audio_of``).

Bounds: the header limits of ``probe_video`` (pixels, frames, duration: over one, nothing is
decoded here; the whole-bytes path answers 413 after arrival), ``max_kept_bytes`` of kept frames,
each also taken from the server's ``DecodeBudget`` (none left: not kept), a deadline, a cap on
concurrent early decoders, and ``cancel`` (a manifest/cache hit, the item dropped, the body
failed), which stops the thread at its next packet and frees the frames.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Callable

import av

from mm_pipeline.media.arriving_bytes import ArrivingBytes
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl, check, check_frame_size, frame_nbytes
from mm_pipeline.media.decode.early_audio import EarlyAudioDecode, audio_reading
from mm_pipeline.media.decode.early_packets import KeyframeSkip, PresentationRanks
from mm_pipeline.media.decode.decoder_memory import codec_threads
from mm_pipeline.media.decode.video import skips_nonref
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.av_container import open_av_stream, sizeless_video, video_stream
from mm_pipeline.media.sniff import fragments_duration
from mm_pipeline.media.types import MediaKind
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames

_SLACK = {"index": 0, "duration": 2, "fragments": 2}  # frame counts kept either side of the prediction
PREDICTABLE = ("index", "matroska", "fragments")  # layouts (sniff.streamable_layout) whose header may give the count
_HEAD = 1 << 20  # bytes a fragmented MP4's stated duration is looked for in (before the first moof)


class EarlyVideoDecode:
    """One video decoded on its own thread while its bytes arrive; frames kept by pts.

    Invariant (under ``_cond``): every kept frame's pts <= ``_last_pts``; ``_kept_bytes`` = the sum
    of ``_sizes`` (each kept frame's own planes, as decoded: its size and pixel format, not the
    header's) <= ``max_kept_bytes``, and it is what this decode holds of ``budget`` (when given);
    once ``_ended`` no frame is added."""

    kind = MediaKind.VIDEO

    def __init__(self, body: ArrivingBytes, layout: str, sampling: VideoSamplingParams, max_kept_bytes: int,
                 timeout_s: float, threads: int = 1, on_end: Callable[[], None] | None = None,
                 budget: DecodeBudget | None = None, sound: EarlyAudioDecode | None = None,
                 limits: MediaLimits = MediaLimits()) -> None:
        self.body = body
        self.limits, self.over_limits = limits, False  # over_limits: the header broke one (module doc)
        self.sound = sound  # the sound track, decoded on its own reader (module doc); None: after arrival
        self.budget = budget
        self.layout = layout  # sniff.streamable_layout's answer
        self.received_at_start = body.received  # bytes in when decoding started (the rest: outstanding)
        self.sampling = sampling
        self.max_kept_bytes = max_kept_bytes
        self.threads = threads
        self.control = DecodeControl(timeout_s, what="an arriving video")
        self.received_at_first_frame: int | None = None  # bytes in when the first frame came out
        self.frames_decoded = 0  # frames that came out of the decoder (unkept non-reference ones are not decoded)
        self.skip = KeyframeSkip()  # span tails dropped undecoded (``skip.skipped``), when it applies
        self.prediction = ""  # how the frame count was known: index / duration / fragments ("": not known)
        self.stream_index: int | None = None  # the stream decoded (av_container.video_stream), once opened
        self._on_end = on_end
        self._cond = threading.Condition()
        self._frames: dict[int, av.VideoFrame] = {}
        self._kept_bytes = 0
        self._last_pts: int | None = None
        self._stop_pts: int | None = None  # production needs nothing after this pts
        self._ended = False
        self._dropped = False  # cancelled: keep nothing more
        self._exact: set[int] | None = None  # pts production wants (retarget), else the prediction
        self._sizes: dict[int, int] = {}  # pts -> bytes of that kept frame
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mmserve-early-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop decoding frames and sound, free both (safe from any thread, any number of times)."""
        self.cancel_frames()
        if self.sound is not None:
            self.sound.cancel()

    def cancel_frames(self) -> None:
        """Stop at the next packet and drop the kept frames; the sound track decodes on (production
        needs no early frame, the planner may still want the sound)."""
        self.control.cancel()
        with self._cond:
            self._dropped = True
            self._drop(list(self._frames))
            self._cond.notify_all()

    def stop_after(self, pts: int) -> None:
        """Production needs no frame after ``pts``: the decoder stops once it is past it."""
        with self._cond:
            self._stop_pts = pts

    def retarget(self, wanted_pts: Sequence[int]) -> None:
        """The exact frames production wants (known once the whole body was demuxed): from now on
        keep these, not the predicted ones, and drop kept frames nobody wants."""
        with self._cond:
            self._exact = set(wanted_pts)
            self._drop([p for p in self._frames if p not in self._exact])

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def last_pts(self) -> int | None:
        with self._cond:
            return self._last_pts

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    def frames_until(self, wanted: Sequence[int], control: DecodeControl | None = None) -> dict[int, av.VideoFrame]:
        """Wait until the decoder is past the last of the ``wanted`` pts (or ended); the kept
        frames among them (the rest: not kept, decode them)."""
        last = max(wanted)
        with self._cond:
            while not self._ended and (self._last_pts is None or self._last_pts < last):
                self._cond.wait(0.05)
                check(control)
            taken = {p: self._frames[p] for p in wanted if p in self._frames}
            self._drop(list(taken))  # production holds them now, under its own reservation
            return taken

    def _drop(self, pts: Sequence[int]) -> None:
        """Forget the kept frames at ``pts`` and give their bytes back (caller holds ``_cond``)."""
        freed = 0
        for p in pts:
            del self._frames[p]
            freed += self._sizes.pop(p)
        self._kept_bytes -= freed
        if self.budget is not None and freed:
            self.budget.release_early(freed)

    # ---- the decoder thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with open_av_stream(self.body.reader(), self.limits.max_pixels) as container:
                stream = video_stream(container)  # probe_video's choice: production takes frames by pts
                # none, but one whose size read 0: over max_pixels (FFmpeg refused it in the open) or damaged
                self.over_limits = stream is None and bool(sizeless_video(container))
                if stream is not None:
                    with self._cond:
                        self.stream_index = stream.index
                    self._decode(container, stream)
        except BaseException as exc:  # a body that failed, a damaged stream, cancel, deadline
            self._error = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
            if self._on_end is not None:
                self._on_end()

    def _decode(self, container: av.container.InputContainer, stream: av.VideoStream) -> None:
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        width, height = stream.codec_context.width, stream.codec_context.height
        lim = self.limits  # as probe_video's: a small file can declare huge frames, or days of them
        too_big = width * height > lim.max_pixels
        totals = self._predict(container, stream, fps) if fps > 0 and not too_big else None
        most = min(lim.max_frames, lim.max_duration_s * fps)
        self.over_limits = too_big or (totals is not None and max(totals) > most)
        if totals is None or self.over_limits:
            return  # over a limit, or no frame count known up front (fragmented MP4, Ogg): after arrival
        keep = self._targets(totals, fps)
        last_kept = max(keep)
        used = codec_threads(self.threads, width * height)
        cc = stream.codec_context
        if used > 1:  # as decode_range does: FFmpeg's own threads, output bit-identical
            stream.thread_type = "AUTO"
            cc.thread_count = used
        # unkept non-reference frames dropped as decode_range does; span tails too (module doc) with
        # one decoder thread (frame threads would hold a kept frame back until later packets come)
        ranks = PresentationRanks() if skips_nonref(stream) else None
        skip = self.skip if ranks is not None and used == 1 else None
        mode = cc.skip_frame = "DEFAULT"
        index = 0
        for packet in container.demux(stream):
            check(self.control)
            need, rank = True, None
            if ranks is not None and packet.pts is not None:
                rank = ranks.add(packet.pts)
                exact = self._exact  # (retarget swaps the set whole; reading it is atomic)
                need = rank in keep if exact is None else packet.pts in exact
            batch = [(packet, need)] if skip is None else skip.feed(packet, need)
            if batch is None:
                return  # out of order after a dropped span: production decodes the rest
            if not batch:  # held: no kept frame is in it, so production may count it as passed
                with self._cond:
                    if self._pass(packet.pts, rank, last_kept):
                        return
                continue
            refs = {p.pts for p, _ in batch if p is not packet}  # held ones, decoded as references: never kept
            for pkt, pkt_need in batch:
                if ranks is not None and pkt.pts is not None and mode != (want := "DEFAULT" if pkt_need else "NONREF"):
                    mode = cc.skip_frame = want
                for frame in cc.decode(pkt):
                    self.frames_decoded += 1
                    if ranks is not None and frame.pts is not None:
                        index = ranks.rank(frame.pts)
                    if self.received_at_first_frame is None:
                        self.received_at_first_frame = self.body.received
                    check_frame_size(frame, width, height, "an arriving video")
                    nbytes = frame_nbytes(frame)  # kept frames stay as decoded (YUV) until used
                    with self._cond:
                        wanted = (frame.pts not in refs and frame.pts not in self._frames
                                  and (index in keep if self._exact is None else frame.pts in self._exact))
                        if (wanted and not self._dropped and self._kept_bytes + nbytes <= self.max_kept_bytes
                                and (self.budget is None or self.budget.take_early(nbytes))):
                            self._frames[frame.pts] = frame
                            self._sizes[frame.pts] = nbytes
                            self._kept_bytes += nbytes
                        if self._pass(frame.pts, index, last_kept):
                            return
                    index += 1  # (with ranks: replaced by the next frame's rank)

    def _pass(self, pts: int | None, index: int | None, last_kept: int) -> bool:
        """Past ``pts`` (a decoded frame, or a held packet: never kept): wake waiting chunks; True
        when past everything it serves (stop). Caller holds ``_cond``."""
        if pts is not None:
            self._last_pts = pts if self._last_pts is None else max(self._last_pts, pts)
        self._cond.notify_all()
        if self._stop_pts is not None and self._last_pts is not None and self._last_pts >= self._stop_pts:
            return True
        # past every frame the prediction keeps: the rest would be wasted
        return self._exact is None and index is not None and index >= last_kept

    def _predict(self, container: av.container.InputContainer, stream: av.VideoStream,
                 fps: float) -> tuple[int, ...] | None:
        """The frame count from the container's own header (one or two candidates), or None (a
        Matroska without a duration, a fragmented MP4 that states none): then the video is decoded
        after arrival (module doc)."""
        if self.layout == "index" and stream.frames > 0:  # the MP4 sample table counts them exactly
            self.prediction = "index"
            return (stream.frames,)
        seconds = None
        if self.layout == "matroska" and container.duration:  # the Segment's duration (microseconds)
            self.prediction, seconds = "duration", container.duration / 1e6
        elif self.layout == "fragments":  # mehd / a global sidx, if any (the demuxer has read past them)
            seconds = fragments_duration(self.body.head(_HEAD))
            self.prediction = "fragments" if seconds else ""
        if not seconds:
            return None
        # duration x rate; FFmpeg's average rate of a fragmented MP4 with sound is off (29.62 for a
        # 30 fps video, measured: 22 frames short over 60 s), its guessed rate is not: both counted
        rates = {fps, float(stream.guessed_rate or fps)}
        return tuple(sorted({max(1, round(seconds * r)) for r in rates}))

    def _targets(self, totals: Sequence[int], fps: float) -> set[int]:
        slack = _SLACK.get(self.prediction, 2)
        out: set[int] = set()
        for total in totals:
            for n in range(max(1, total - slack), total + slack + 1):
                out.update(sample_frames(n, fps, self.sampling).indices)
        return out


class EarlyDecoders:
    """Starts the early decodes of one runtime (``MediaIngestor.early_decode``): a video whose
    header gives its frame count (and its sound track, with ``video_sound``), or an audio item
    (``early_audio.audio_reading``); at most ``limit`` threads at once (none free: the item or the
    sound is decoded after arrival, as without this feature). ``audio_rate``: the audio encoder's
    sample rate (None: no audio decoded early); ``video_sound``: the model hears videos."""

    def __init__(self, sampling: VideoSamplingParams, limits: MediaLimits, fetch_timeout_s: float,
                 threads: int = 1, limit: int = 4, budget: DecodeBudget | None = None, audio_rate: int | None = None,
                 context_samples: int | None = None, video_sound: bool = False) -> None:
        if limit < 1:
            raise ValueError(f"EarlyDecoders limit must be >= 1, got {limit}")
        self.sampling = sampling
        self.limits = limits
        # arrival is bounded by the fetch deadline, the decode after it by the decode deadline
        self.timeout_s = fetch_timeout_s + limits.decode_timeout_s
        self.threads = threads
        self.budget = budget or DecodeBudget(limits.max_decoded_bytes_in_flight)
        self.audio_rate = audio_rate
        self.context_samples = context_samples
        self.video_sound = video_sound and audio_rate is not None
        self._slots = threading.BoundedSemaphore(limit)

    def start(self, body: ArrivingBytes, layout: str, kind: MediaKind | None = None,
              origin: str = "remote") -> EarlyVideoDecode | EarlyAudioDecode | None:
        head = body.head(_HEAD)
        reading = audio_reading(head, layout, kind, body.declared_size, body.has_tail) if self.audio_rate else None
        if reading is None and (kind is MediaKind.AUDIO or layout not in PREDICTABLE
                                or (layout == "fragments" and not fragments_duration(head))):
            return None  # nothing to decode early: no frame count up front (module doc)
        if not self._slots.acquire(blocking=False):
            return None
        early: EarlyVideoDecode | EarlyAudioDecode
        if reading is not None:
            assert self.audio_rate is not None
            early = EarlyAudioDecode(body, self.audio_rate, self.limits, self.context_samples, self.timeout_s,
                                     self.budget, reading, origin, on_end=self._slots.release)
        else:
            # kept frames: at most half the request's decoded-bytes budget (production converts them
            # under its own reservations, as it does frames it decodes itself)
            early = EarlyVideoDecode(body, layout, self.sampling, self.limits.max_request_decoded_bytes // 2,
                                     self.timeout_s, self.threads, on_end=self._slots.release, budget=self.budget,
                                     sound=self._sound_track(body, origin), limits=self.limits)
        early.start()
        return early

    def _sound_track(self, body: ArrivingBytes, origin: str) -> EarlyAudioDecode | None:
        """A video's sound track decoding on its own reader (module doc), or None: the model does
        not hear videos, or no thread is free (decoded after arrival). A video without sound ends
        its thread at the header (no audio stream: the planner asks for none)."""
        if not self.video_sound or not self._slots.acquire(blocking=False):
            return None
        assert self.audio_rate is not None
        sound = EarlyAudioDecode(body, self.audio_rate, self.limits, self.context_samples, self.timeout_s,
                                 self.budget, (True, False), origin, on_end=self._slots.release)
        sound.start()
        return sound
