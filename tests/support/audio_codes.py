"""The RVQ codes a reference-path checkpoint's own tokenizer makes of a clip: what a client that
ran the tokenizer itself sends as ``input_audio_codes`` (tests compare its answer with the clip's)."""

from __future__ import annotations

import torch

from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.types import MediaItem, MediaKind


def tokenizer_codes(runtime, data: bytes) -> torch.Tensor:
    """Codes [channels, frames] of the audio file ``data``, tokenized segment by segment (the
    serving path's segments), the channels the speech input reads."""
    model = runtime.model
    audio = decode_audio(MediaItem(MediaKind.AUDIO, "wav", data), model.audio_config.sampling_rate)
    per_segment = model.audio.tokenize_segments(runtime.pre.audio_segments(audio))
    return torch.cat(per_segment)[:, :len(model.audio.codebook_sizes)].T
