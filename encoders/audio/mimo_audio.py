"""The MiMo-V2.5 reference audio encoder: log-mel segments -> RVQ codes -> LLM embeddings.

    segment mel [<= segment_size, n_mels] --AudioTokenizerEncoder (audio_tokenizer/, encoder.*)-->
      codes [n2, num_quantizers] --SpeechInput (speech_embeddings.*, audio_encoder.*)--> [G, out_hidden]

It offers the interface of our :class:`encoders.audio.encoder.AudioEncoder` (``encode_segments``,
``forward``, ``config``, ``device``, ``dtype``), so the encoder batcher, the cache and streaming treat
both paths alike: the unit is still one ``segment_size`` segment, and its row count is
``AudioConfig.segment_tokens`` (docs/model.md §4). Pre-tokenized codes skip the tokenizer:
:meth:`encode_codes`, and a batch may mix both (:meth:`encode_segments_and_codes`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from encoders.audio.mimo_config import AudioTokenizerConfig, SpeechInputConfig
from encoders.audio.packing import encode_clips
from encoders.audio.rvq_tokenizer import AudioTokenizerEncoder
from encoders.audio.speech_input import SpeechInput
from encoders.config import AudioConfig


def check_geometry(front: AudioConfig, tokenizer: AudioTokenizerConfig, speech: SpeechInputConfig) -> None:
    """The token-count rule (``front``) must describe what the tokenizer and grouping produce."""
    pairs = {"n_mels": (front.n_mels, tokenizer.n_mels), "stride_size": (front.stride_size, tokenizer.stride_size),
             "kernel_size": (front.kernel_size, tokenizer.kernel_size),
             "avg_pooler": (front.avg_pooler, tokenizer.avg_pooler), "group_size": (front.group_size, speech.group_size),
             "out_hidden_size": (front.out_hidden_size, speech.out_hidden_size)}
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError(f"audio config disagrees with the audio tokenizer / speech input configs "
                         f"(audio_config/processor value, tokenizer/speech value): {bad}")
    if tokenizer.num_quantizers < speech.audio_channels:
        raise ValueError(f"the tokenizer makes {tokenizer.num_quantizers} code channels, the speech input "
                         f"needs {speech.audio_channels}")
    short = [c for c in range(speech.audio_channels) if speech.speech_vocab_size[c] < tokenizer.codebook_size[c]]
    if short:
        raise ValueError(f"speech_embeddings of channels {short} are smaller than their codebooks")


class MimoAudioEncoder(nn.Module):
    def __init__(self, front: AudioConfig, tokenizer: AudioTokenizerConfig, speech: SpeechInputConfig,
                 device=None, dtype=None) -> None:
        super().__init__()
        check_geometry(front, tokenizer, speech)
        self.config = front
        self.tokenizer = AudioTokenizerEncoder(tokenizer, device=device, dtype=dtype)
        self.speech = SpeechInput(speech, device=device, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.tokenizer.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tokenizer.conv1.weight.dtype

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        """Codebook size of each RVQ stage the speech input reads (its ``audio_channels`` first
        stages): what a pre-tokenized code of each channel must be below."""
        return self.tokenizer.config.codebook_size[:self.speech.config.audio_channels]

    @torch.no_grad()
    def tokenize_segments(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel segments (each <= segment_size frames) -> RVQ codes [n2, num_quantizers] each."""
        for s in segments:
            if s.dim() != 2 or s.shape[1] != self.config.n_mels or s.shape[0] == 0:
                raise ValueError(f"audio segments must be [T>0, {self.config.n_mels}], got {tuple(s.shape)}")
            if s.shape[0] > self.config.segment_size:
                raise ValueError(f"segment of {s.shape[0]} frames exceeds segment_size {self.config.segment_size}")
        return self.tokenizer.tokenize(segments) if segments else []

    @torch.no_grad()
    def encode_codes_batch(self, codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Codes [T_i, >= audio_channels] -> embeddings [ceil(T_i / group), out_hidden] each, one forward."""
        if not codes:
            return []
        grouped = [self.speech.group_codes(c.to(self.device)) for c in codes]
        out = self.speech(torch.cat(grouped))
        return list(torch.split(out, [g.shape[0] for g in grouped]))

    @torch.no_grad()
    def encode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Pre-tokenized audio (codes [T, >= audio_channels] at 25 Hz) -> embeddings, one per group."""
        return self.encode_codes_batch([codes])[0]

    @torch.no_grad()
    def encode_segments(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode mel segments in one tokenizer forward and one speech-input forward -> per segment."""
        return self.encode_codes_batch(self.tokenize_segments([s.to(self.device) for s in segments]))

    @torch.no_grad()
    def encode_segments_and_codes(self, segments: Sequence[torch.Tensor], codes: Sequence[torch.Tensor]
                                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Mel segments and pre-tokenized code segments of one batch: the mels through the
        tokenizer, then all codes through one speech-input forward -> (mel rows, code rows)."""
        tokenized = self.tokenize_segments([s.to(self.device) for s in segments]) if segments else []
        out = self.encode_codes_batch(tokenized + list(codes))
        return out[:len(tokenized)], out[len(tokenized):]

    @torch.no_grad()
    def forward(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Whole clips (log-mels [T, n_mels]); long clips are cut into segments first."""
        return encode_clips(mels, self.config.segment_size, self.encode_segments)
