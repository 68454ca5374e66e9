"""Decoded media -> encoder inputs, with torch ops on the encoder's device.

    DecodedImage  [H, W, 3] uint8  --to device, CHW--> smart_resize + normalise + patchify
                  -> one vision unit (rows [gh*gw, patch_dim], grid (1, gh, gw))
    video frames  [T, H, W, 3] uint8 (T even, a chunk of whole groups) at a size fixed for the video
                  -> one vision unit per temporal group (2 frames), grid (1, gh, gw) each
    DecodedAudio  [N] float mono  --log-mel on device--> segments of <= segment_size mel frames
                  -> one audio unit per segment
    AudioCodes    [frames, channels] int32 (pre-tokenized, media/audio_codes.py) --checked against
                  the model's codebooks--> segments of <= codes_per_segment frames (the audio's own
                  segments) -> one audio unit per segment

Sizes are functions of metadata only (image size, the video's frame count and size, audio sample
count), so a prompt can be laid out before any pixel is processed; the token count of a size is
``encoders.config.unit_tokens``. The uint8 frames travel to the device before the float conversion
(4x fewer bytes over the bus). The decoders already scaled them in uint8 (video frames to the
video's size, large images to at most twice their target), so the float copy made here is of a
frame near the target size, never of an 8192² source frame.

On CUDA the media workers run that device work on a side stream and hand over finished tensors
(encode/device_streams.py): the encoder's stream never reads half-normalised rows, and the
preprocessing does not queue behind the LLM step on the default stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from encoders.audio.packing import split_segments
from encoders.config import AudioConfig, unit_tokens
from encoders.image_processing import (MAX_ASPECT_RATIO, AspectRatioError, ImageProcessingConfig, normalize,
                                       normalize_rows, patchify, resize_frames, smart_resize)
from encoders.audio.mel import LogMelSpectrogram
from mm_pipeline.encode.device_streams import SideStream, read_by
from mm_pipeline.errors import InvalidMediaError
from mm_pipeline.media import audio_codes
from mm_pipeline.media.audio_codes import AudioCodes
from mm_pipeline.media.types import DecodedAudio, DecodedImage


@dataclass(frozen=True)
class VisionInput:
    """Patch rows of one vision unit (an image or one video frame group) and its grid (t, gh, gw)."""

    rows: torch.Tensor
    grid: tuple[int, int, int]

    @property
    def num_patches(self) -> int:
        return int(self.rows.shape[0])


class Preprocessor:
    """Pixel and audio preprocessing for one omni model (configs + the encoders' device)."""

    def __init__(self, image_config: ImageProcessingConfig, audio_config: AudioConfig | None = None,
                 device: str | torch.device = "cpu", audio_codebooks: tuple[int, ...] | None = None) -> None:
        """``audio_codebooks``: per RVQ stage the model reads, its codebook size (the reference
        audio path, ``MimoAudioEncoder.codebook_sizes``); None: pre-tokenized codes are refused."""
        self.image_config = image_config
        self.audio_config = audio_config
        self.audio_codebooks = audio_codebooks if audio_config is not None else None
        self.device = torch.device(device)
        self.side = SideStream(self.device)  # CUDA: the media workers' stream (encode/device_streams.py)
        self._mel = LogMelSpectrogram(audio_config) if audio_config is not None else None

    # ---- sizes from metadata ----------------------------------------------------------------
    # The planner asks these with the size a header or a demux pass reported, before any pixel is
    # decoded: a shape the vision tower cannot take fails there, as the client's media error.
    def image_size(self, height: int, width: int) -> tuple[int, int]:
        c = self.image_config
        try:
            return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)
        except AspectRatioError as exc:
            raise _too_thin("image", height, width) from exc

    def video_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """Resized frame size of a video of ``num_frames`` sampled frames (padded count)."""
        c = self.image_config
        try:
            return smart_resize(height, width, c.factor, c.video_min_pixels, c.video_frame_max_pixels(num_frames))
        except AspectRatioError as exc:
            raise _too_thin("video", height, width) from exc

    def video_grid(self, size: tuple[int, int], num_frames: int) -> tuple[int, int, int]:
        """(frame groups, gh, gw) of a video whose ``num_frames`` sampled frames resize to ``size``."""
        c = self.image_config
        return num_frames // c.temporal_patch_size, size[0] // c.patch_size, size[1] // c.patch_size

    def unit_tokens(self, kind: str, shape: Sequence[int]) -> tuple[int, ...]:
        """Tokens per unit of a media item (:func:`encoders.config.unit_tokens` with this model's
        merge size and audio config): ``shape`` is an image/video grid or an audio clip's (mel frames,)."""
        return unit_tokens(kind, shape, merge_size=self.image_config.merge_size, audio=self.audio_config)

    # ---- tensors ----------------------------------------------------------------------------
    def image(self, image: DecodedImage, size: tuple[int, int] | None = None) -> VisionInput:
        """``size``: the resized (h, w) planned from the source's header (the pixels may arrive
        already shrunk, see decode_image); default: from the pixels' own size."""
        with self.side.finished():
            frames = self._frames_chw(image.pixels[None])
            h, w = size or self.image_size(frames.shape[-2], frames.shape[-1])
            rows, grid = self._patchify(frames, h, w)
        return VisionInput(rows, grid)

    def video_groups(self, frames: torch.Tensor, size: tuple[int, int]) -> list[VisionInput]:
        """Frames [T, H, W, 3] uint8 of whole groups (T a multiple of the temporal patch) at the
        video's resized ``size`` -> one input per group, in time order."""
        tp = self.image_config.temporal_patch_size
        if frames.dim() != 4 or frames.shape[0] == 0 or frames.shape[0] % tp:
            raise ValueError(f"video chunk must be [T, H, W, 3] with T a positive multiple of {tp}, "
                             f"got {tuple(frames.shape)}")
        with self.side.finished():
            rows, (t, gh, gw) = self._patchify(self._frames_chw(frames), *size)
        per = gh * gw
        return [VisionInput(rows[k * per:(k + 1) * per], (1, gh, gw)) for k in range(t)]

    def audio_segments(self, audio: DecodedAudio) -> list[torch.Tensor]:
        """Log-mel segments [<= segment_size, n_mels] of a clip (on the device)."""
        cfg = self._need_audio()
        if audio.sample_rate != cfg.sampling_rate:
            raise ValueError(f"audio decoded at {audio.sample_rate} Hz; the encoder wants {cfg.sampling_rate} Hz")
        assert self._mel is not None
        with self.side.finished():
            mel = self._mel(audio.samples.to(self.device), audio.sample_rate)
        return split_segments(mel, cfg.segment_size)

    def cached_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Encoder rows read back from the encoder cache's tiers (host memory) on the encoder's
        device, where fresh ones arrive (CUDA): copied on the side stream by the calling media
        worker, complete when returned, and kept from reuse until the device's default stream (the
        LLM's prefill) is done with them. On the event loop the copy would wait behind the LLM step
        queued on the default stream."""
        if self.device.type != "cuda" or rows.device == self.device:
            return rows
        with self.side.finished():
            out = rows.to(self.device, non_blocking=True)
        read_by([out], torch.cuda.default_stream(self.device))
        return out

    def check_codes(self, codes: AudioCodes, max_duration_s: float) -> None:
        """Pre-tokenized codes against this model (channels, codebook ranges, duration limit)."""
        rate = self.audio_config.code_frames_per_second if self.audio_config is not None else 0.0
        audio_codes.check_codes(codes, self.audio_codebooks, rate, max_duration_s)

    def code_segments(self, codes: AudioCodes) -> list[torch.Tensor]:
        """Checked codes cut into the segments the tokenizer made of their audio (CPU int32: the
        speech input moves them)."""
        return audio_codes.code_segments(codes, self._need_audio().codes_per_segment)

    # ---- internal helpers -------------------------------------------------------------------
    def _frames_chw(self, frames_hwc: torch.Tensor) -> torch.Tensor:
        if frames_hwc.dtype != torch.uint8 or frames_hwc.dim() != 4 or frames_hwc.shape[-1] != 3:
            raise ValueError(f"frames must be [T, H, W, 3] uint8, got {tuple(frames_hwc.shape)} {frames_hwc.dtype}")
        return frames_hwc.to(self.device, non_blocking=True).permute(0, 3, 1, 2)

    def _patchify(self, frames: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """uint8 frames [T, C, H, W] -> normalised float rows. Frames already at (h, w) (every video
        frame, small images) are patchified as uint8 and normalised as rows: one byte-sized reorder
        and one float copy instead of float frames, two normalise temporaries and a float reorder."""
        c = self.image_config
        if tuple(frames.shape[-2:]) == (h, w):
            rows, grid = patchify(frames, c.patch_size, c.temporal_patch_size, c.merge_size)
            return normalize_rows(rows.float(), c.mean, c.std), grid
        x = normalize(resize_frames(frames.float(), h, w), c.mean, c.std)
        rows, grid = patchify(x, c.patch_size, c.temporal_patch_size, c.merge_size)
        return rows.contiguous(), grid

    def _need_audio(self) -> AudioConfig:
        if self.audio_config is None:
            raise ValueError("this model has no audio encoder")
        return self.audio_config


def _too_thin(what: str, height: int, width: int) -> InvalidMediaError:
    # our own sentence (the client reads it; the encoder's text stays in the log with the cause)
    return InvalidMediaError(f"the {what} is {width}x{height} pixels: an aspect ratio of "
                             f"{max(height, width) / min(height, width):.1f}, over the {MAX_ASPECT_RATIO} "
                             f"the vision encoder takes")
