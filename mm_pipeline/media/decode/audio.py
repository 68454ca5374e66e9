"""Audio from any container/codec PyAV reads → mono float32 at the rate the encoder wants
(docs/model.md §4: resample, then average the channels).

FFmpeg's resampler (swresample) converts rate and sample format per channel; the channels are then
averaged with equal weights, not down-mixed with swresample's centre/surround gains, so a stereo
file with one silent channel comes out at half amplitude, as the reference processor does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import av
import numpy as np
import torch

from mm_pipeline.errors import ContextLengthError, MediaError, MediaTooLarge, UndecodableMediaError, UnsupportedMediaType
from mm_pipeline.media.decode.budget import DecodeControl, check
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DecodedAudio, MediaItem
from mm_pipeline.media.sniff import open_av

# The lowest input sample rate decoded. One decoded frame is resampled in one call, and its output
# is allocated whole (then copied by to_ndarray and the channel mean) before any limit can look at
# it: a FLAC block holds up to 65,535 samples, which at 10 Hz resample to 157 M samples at 24 kHz
# (GBs from a 78-byte file). At 1 kHz one frame resamples to at most 65,535 x 24 = 1.6 M samples
# (6 MiB); no speech or music is recorded below 1 kHz (telephony, the lowest in use, is 8 kHz).
MIN_INPUT_RATE = 1000

def decode_audio(item: MediaItem, sample_rate: int, limits: MediaLimits = MediaLimits(),
                 control: DecodeControl | None = None, context_samples: int | None = None) -> DecodedAudio:
    """Decode the first audio stream of ``item`` to mono float32 at ``sample_rate`` Hz.

    Raises ``MediaTooLarge`` when the header or the decoded length exceeds
    ``limits.max_duration_s``, ``UndecodableMediaError`` for damaged data or no audio stream,
    ``ContextLengthError`` as soon as more than ``context_samples`` are decoded (the most the
    model's context can hold: counted as decoded, never trusting a header's duration, so an hour
    of silence stops after the first seconds past the limit), ``UndecodableMediaError`` too for a
    float stream holding NaN / Inf samples, ``UnsupportedMediaType`` for audio sampled below
    ``MIN_INPUT_RATE``. Both length limits are checked on each frame's resampled size before it is
    resampled, so no frame's output is ever allocated past them."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    try:
        with open_av(item.data) as container:
            return decode_audio_from(container, item, sample_rate, limits, control, context_samples)
    except av.FFmpegError as exc:
        raise UndecodableMediaError(f"{item.format} audio from {item.origin} does not decode ({exc})") from exc


def decode_audio_from(container: av.container.InputContainer, item: MediaItem, sample_rate: int,
                      limits: MediaLimits, control: DecodeControl | None = None, context_samples: int | None = None,
                      check_header: bool = True, grow: Callable[[int], None] | None = None) -> DecodedAudio:
    """``decode_audio`` on an opened container: the whole bytes, or bytes still arriving
    (``media.decode.early_audio``, which checks the header of the whole bytes itself, and is told
    of each resampled chunk's bytes through ``grow``, which may raise to stop). Raises
    ``av.FFmpegError`` as PyAV does."""
    chunks: list[np.ndarray] = []
    total = 0
    if not container.streams.audio:
        raise UndecodableMediaError(f"{item.format} from {item.origin} has no audio stream")
    stream = container.streams.audio[0]
    if check_header:
        check_header_seconds(_header_duration(container, stream), limits)
    resampler: av.AudioResampler | None = None
    setup = None  # (sample format, layout, rate) of the frames the resampler was made for
    for frame in _frames_then_flush(container, stream):
        check(control)
        outs = []
        if frame is not None and (frame.format.name, frame.layout.name, frame.sample_rate) != setup:
            # the first frame, or a stream whose rate / layout / format changes midway (concatenated
            # files, a damaged one): the old resampler's tail first, then one for the new frames --
            # PyAV's resampler takes only frames like its first (ValueError otherwise)
            if resampler is not None:
                outs += _resample(resampler, None, item)
            _check_input_rate(frame.sample_rate, item)
            # packed float ("flt"), not planar: PyAV's planar to_ndarray reads past FFmpeg's eight
            # data pointers on a frame of 8+ channels (an ordinary 7.1 track) and crashed the process
            resampler = av.AudioResampler(format="flt", layout=frame.layout.name, rate=sample_rate)
            setup = (frame.format.name, frame.layout.name, frame.sample_rate)
        if resampler is None:
            break
        if frame is not None:
            # the samples resampling this frame makes, checked before they exist (MIN_INPUT_RATE
            # says why); the resampler holds back its filter delay, so the total after it is at most this
            _check_length(total + -(-frame.samples * sample_rate // frame.sample_rate), item, sample_rate, limits,
                          context_samples)
        for out in outs + _resample(resampler, frame, item):
            # [1, samples * channels] float32, interleaved: one row per sample, its channels averaged
            samples = out.to_ndarray().reshape(-1, len(out.layout.channels))
            chunks.append(samples.mean(axis=1, dtype=np.float32))
            if not np.isfinite(chunks[-1]).all():
                # float sample formats (float WAV, AIFF-C, CAF...) can carry NaN / Inf and the
                # resampler passes them on; the encoder cannot make anything of them, so the
                # request is refused here rather than encoded into NaN embeddings
                raise UndecodableMediaError(
                    f"{item.format} audio from {item.origin} holds non-finite samples (NaN or Inf); "
                    f"send finite audio")
            total += samples.shape[0]
            if grow is not None:
                grow(chunks[-1].nbytes)
        _check_length(total, item, sample_rate, limits, context_samples)
    if total == 0:
        raise UndecodableMediaError(f"{item.format} from {item.origin} holds no audio samples")
    samples = torch.from_numpy(np.concatenate(chunks).astype(np.float32, copy=False))
    return DecodedAudio(samples, sample_rate, item.format)


def _check_input_rate(rate: int, item: MediaItem) -> None:
    if rate < MIN_INPUT_RATE:
        raise UnsupportedMediaType(f"{item.format} audio from {item.origin} is sampled at {rate} Hz; audio below "
                                   f"{MIN_INPUT_RATE} Hz is not decoded")


def _check_length(samples: int, item: MediaItem, sample_rate: int, limits: MediaLimits,
                  context_samples: int | None) -> None:
    """``samples`` at ``sample_rate`` Hz (decoded, or about to be) against ``max_duration_s`` and
    the model's context."""
    if samples > int(limits.max_duration_s * sample_rate):
        raise MediaTooLarge(f"audio lasts over {limits.max_duration_s} s (decoded)")
    if context_samples is not None and samples > context_samples:
        raise ContextLengthError(
            f"audio from {item.origin} is longer than the model's context holds "
            f"(over {context_samples / sample_rate:.1f} s decoded); send a shorter clip")


def _resample(resampler: av.AudioResampler, frame: av.AudioFrame | None, item: MediaItem) -> list[av.AudioFrame]:
    """``resampler.resample(frame)`` (None: flush); a frame it cannot take is the file's fault."""
    try:
        return resampler.resample(frame)
    except ValueError as exc:
        raise UndecodableMediaError(f"{item.format} audio from {item.origin} does not decode ({exc})") from exc


def check_header_seconds(seconds: float | None, limits: MediaLimits) -> None:
    """The duration a header claims against ``max_duration_s`` (before any sample is decoded)."""
    if seconds is not None and seconds > limits.max_duration_s:
        raise MediaTooLarge(f"audio lasts {seconds:.1f} s, limit {limits.max_duration_s} s")


def has_audio_stream(item: MediaItem) -> bool:
    """Does the container hold an audio stream? (False too when it does not open.)"""
    try:
        with open_av(item.data) as container:
            return bool(container.streams.audio)
    except (av.FFmpegError, MediaError):
        return False


def header_seconds(item: MediaItem) -> float | None:
    """The duration the container's header claims (None: no claim, or it does not open). Only an
    estimate for budgets: decoding counts samples itself and never trusts it."""
    try:
        with open_av(item.data) as container:
            return _header_duration(container, container.streams.audio[0]) if container.streams.audio else None
    except (av.FFmpegError, MediaError):
        return None


def _frames_then_flush(container: av.container.InputContainer,
                       stream: av.AudioStream) -> Iterator[av.AudioFrame | None]:
    """Decoded frames, then ``None`` (the resampler's flush signal)."""
    for frame in container.decode(stream):
        frame.pts = None  # timestamps are irrelevant here and odd ones upset the resampler
        yield frame
    yield None


def _header_duration(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None
