"""Log-mel front end of the audio encoder (torchaudio).

waveform [samples] or [channels, samples] at any rate -> mono at ``sampling_rate`` -> magnitude mel
(power 1, centred reflect-padded STFT, Hann window, HTK scale, no norm) -> log(clamp(mel, 1e-7))
-> [T_mel, n_mels] with T_mel = 1 + samples // hop_length.

Long audio runs in blocks of frames: the waveform is reflect-padded once and each block's frames
are cut from it (``center=False``), so a frame sees exactly the samples it sees in one whole-clip
STFT, and only one block's spectrum (complex64, ~16 B/sample, plus ``abs``'s complex temporary) is
alive at a time. Whole-clip peak was ~44 B/sample; blocked it is the padded copy and the output
(~6 B/sample at MiMo-V2.5's settings) plus a fixed block.
"""

from __future__ import annotations

import torch
import torchaudio

from encoders.config import AudioConfig

LOG_FLOOR = 1e-7
# STFT frames per block (~8 s of 24 kHz audio at hop 240): the block's frames, spectrum, abs
# temporary and magnitude are ~120 MB at n_fft 960, against ~4 GB for an hour in one piece.
BLOCK_FRAMES = 1 << 13


class LogMelSpectrogram:
    """Stateless apart from the cached torchaudio transform (window + filter bank) per device."""

    def __init__(self, config: AudioConfig) -> None:
        self.config = config
        self._transforms: dict[str, torchaudio.transforms.MelSpectrogram] = {}

    def _transform(self, device: torch.device) -> torchaudio.transforms.MelSpectrogram:
        key = str(device)
        if key not in self._transforms:
            c = self.config
            self._transforms[key] = torchaudio.transforms.MelSpectrogram(
                sample_rate=c.sampling_rate, n_fft=c.n_fft, win_length=c.window_size, hop_length=c.hop_length,
                f_min=c.fmin, f_max=c.fmax, n_mels=c.n_mels, power=1.0, center=True, pad_mode="reflect",
                norm=None, mel_scale="htk",
            ).to(device)
        return self._transforms[key]

    def __call__(self, waveform: torch.Tensor, sample_rate: int | None = None) -> torch.Tensor:
        """Waveform -> log-mel [T_mel, n_mels] (float32, on the waveform's device)."""
        if waveform.dim() == 2:
            waveform = waveform.float().mean(dim=0)  # channels -> mono
        if waveform.dim() != 1:
            raise ValueError(f"waveform must be [samples] or [channels, samples], got {tuple(waveform.shape)}")
        if waveform.numel() == 0:
            raise ValueError("waveform is empty")
        waveform = waveform.float()
        rate = self.config.sampling_rate if sample_rate is None else int(sample_rate)
        if rate <= 0:
            raise ValueError(f"sample rate must be positive, got {rate}")
        if rate != self.config.sampling_rate:
            waveform = torchaudio.functional.resample(waveform, rate, self.config.sampling_rate)
        # Reflect padding needs more than n_fft // 2 samples; zero-pad very short clips to that.
        min_len = self.config.n_fft // 2 + 1
        if waveform.numel() < min_len:
            num = waveform.numel()
            waveform = torch.nn.functional.pad(waveform, (0, min_len - num))
            frames = 1 + num // self.config.hop_length
        else:
            frames = None
        mel = self._blocked(waveform)  # [T, n_mels]
        if frames is not None:
            mel = mel[:frames]
        return mel

    def _blocked(self, waveform: torch.Tensor) -> torch.Tensor:
        """The transform's centred STFT -> magnitude -> mel -> log, a block of frames at a time."""
        c, transform = self.config, self._transform(waveform.device)
        spec = transform.spectrogram
        half = c.n_fft // 2
        padded = torch.nn.functional.pad(waveform[None], (half, half), mode="reflect")[0]
        total = 1 + waveform.numel() // c.hop_length
        out = torch.empty(total, c.n_mels, device=waveform.device)
        for f0 in range(0, total, BLOCK_FRAMES):
            f1 = min(total, f0 + BLOCK_FRAMES)
            piece = padded[f0 * c.hop_length:(f1 - 1) * c.hop_length + c.n_fft]
            mag = torch.stft(piece, n_fft=c.n_fft, hop_length=c.hop_length, win_length=spec.win_length,
                             window=spec.window, center=False, return_complex=True).abs()  # [bins, f1 - f0]
            mel = transform.mel_scale(mag)  # [n_mels, f1 - f0]
            out[f0:f1] = torch.log(torch.clamp(mel, min=LOG_FLOOR)).transpose(0, 1)
        return out
