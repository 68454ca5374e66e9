"""Peak bytes a production holds while it decodes and preprocesses one input: what it reserves in
the decode budget (derived from the intermediates, checked against measured peaks in
tests/mm_pipeline/encode/test_decode_peaks.py and test_decode_peak_rss.py)."""

from __future__ import annotations

from encoders.audio.mel import BLOCK_FRAMES
from encoders.config import AudioConfig
from encoders.image_processing import ImageProcessingConfig


def preprocess_image_bytes(pixels: int, size: tuple[int, int], config: ImageProcessingConfig,
                           same_size: bool = False) -> int:
    """Peak bytes of ``Preprocessor.image`` on ``pixels`` decoded uint8 RGB pixels (3 B each, held
    throughout) resized to ``size`` (T pixels), an image repeated to ``tp`` frames (the temporal
    patch) -- the tensors it holds at once (``Preprocessor._patchify``):

        resized:    the float copy of the pixels (12 B/px) + the resized frame (12 B/T)
                    then the resized frame + (x - mean) + its / std (3 x 12 B/T)
                    then the normalised frame (12 B/T) + patchify's temporal pad (tp frames:
                    12 tp B/T) + the reordered rows (12 tp B/T)
        same size:  the padded uint8 frames (3 tp B/T) + their reorder (3 tp B/T), then the
                    reorder + its float rows (12 tp B/T), normalised in place by a mean and a
                    std row (4 B per row value each, made from 3 channel values)

    The rows it returns are 12 tp B/T (24 at MiMo's tp 2)."""
    t, tp = size[0] * size[1], config.temporal_patch_size
    pad = tp if tp > 1 else 0  # frames patchify's padding copies (none for a one-frame patch)
    if same_size:
        return 3 * pixels + max(3 * pad * t + 3 * tp * t, 3 * tp * t + 12 * tp * t + _mean_std_bytes(config))
    return 3 * pixels + max(12 * pixels + 12 * t, 36 * t, 12 * t + 12 * pad * t + 12 * tp * t)


def video_chunk_bytes(frames: int, size: tuple[int, int], config: ImageProcessingConfig,
                      streamed: bool = False, repeats: int = 0) -> int:
    """Peak bytes of a video chunk's ``frames`` sampled frames (its groups x tp), uint8 RGB at
    ``size`` (T pixels each), turned into patch rows (``Preprocessor.video_groups``: frames already
    at the video's size take the uint8 path) -- beside the decoder's own frames, which
    ``frame_decode_bytes`` counts. ``repeats``: sampled frames that repeat an earlier one (a padded
    tail), decoded once (U = frames - repeats unique rows):

        whole chunk:  its frames (3 B/T each) + patchify's uint8 reorder (3) + its float rows (12):
                      18 B/T per frame (before: a padded tail's repeated rows, copied from the
                      decoded ones, 3 U + 3 frames)
        streamed:     (groups handed on as they decode, ``deliver``) the decoded rows (3 U), the
                      float rows of the groups handed on so far (12 per frame), and the last
                      group's stacked copy, reorder and float rows (3 + 3 + 12 per frame of the
                      group): 3 U + 12 frames + 6 tp; with a padded tail, the chunk's repeated
                      rows copied once every group is out (3 frames) instead

    A one-group chunk streams at 21 B/T per frame; the 15 reserved before held neither the uint8
    reorder nor, streamed, the group's stacked copy."""
    t, tp = size[0] * size[1], config.temporal_patch_size
    if not streamed:
        return 18 * frames * t + _mean_std_bytes(config)
    unique = frames - repeats
    return (3 * unique + 12 * frames + max(6 * tp, 3 * frames if repeats else 0)) * t + _mean_std_bytes(config)


def _mean_std_bytes(config: ImageProcessingConfig) -> int:
    """``normalize_rows``' mean and std rows: float32 per row value, made from 3 channel values."""
    return 2 * 4 * 3 * (config.temporal_patch_size * config.patch_size ** 2 + 1)


def audio_bytes(samples: int, cfg: AudioConfig) -> int:
    """Peak bytes of decoding ``samples`` mono float32 samples and taking their log-mel
    (``Preprocessor.audio_segments``), with F = 1 + samples // hop frames of B = n_fft // 2 + 1
    bins, the front end running a block of at most ``BLOCK_FRAMES`` frames at a time:

        decode:  the resampled chunks (4 B/sample) + their concatenation (4 B/sample)
        log-mel: the waveform (4 B/sample), its reflect-padded copy (n_fft more samples), the output
                 [F, n_mels] float32, and one block: its windowed frames [f, n_fft] float32, the
                 spectrum [B, f] complex64 and the complex temporary of its ``abs``, the magnitude
                 [B, f] float32 and the mel, its clamp and log [n_mels, f] float32

    At 24 kHz, n_fft 960, hop 240, 128 mels: ~10 B/sample plus ~120 MB of block (a whole-clip
    STFT peaked at 44 B/sample)."""
    frames, bins = 1 + samples // cfg.hop_length, cfg.n_fft // 2 + 1
    block = min(frames, BLOCK_FRAMES) * (4 * cfg.n_fft + (8 + 8 + 4) * bins + 3 * 4 * cfg.n_mels)
    log_mel = 4 * samples + 4 * (samples + 2 * (cfg.n_fft // 2)) + 4 * frames * cfg.n_mels + block
    return max(8 * samples, log_mel)
