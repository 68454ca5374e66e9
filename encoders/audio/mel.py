"""Log-mel front end of the audio encoder (torchaudio).

waveform [samples] or [channels, samples] at any rate -> mono at ``sampling_rate`` -> magnitude mel
(power 1, centred reflect-padded STFT, Hann window, HTK scale, no norm) -> log(clamp(mel, 1e-7))
-> [T_mel, n_mels] with T_mel = 1 + samples // hop_length.
"""

from __future__ import annotations

import torch
import torchaudio

from encoders.config import AudioConfig

LOG_FLOOR = 1e-7


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
        mel = self._transform(waveform.device)(waveform)  # [n_mels, T]
        if frames is not None:
            mel = mel[:, :frames]
        return torch.log(torch.clamp(mel, min=LOG_FLOOR)).transpose(0, 1).contiguous()
