"""Audio encoder: equivalence against a dense per-segment reference written here, packed == one by one,
segmenting, token counts, the log-mel front end, checkpoint round trip and config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchaudio
from hypothesis import given, settings
from hypothesis import strategies as st

from encoders.audio.encoder import AudioEncoder
from encoders.audio.packing import AudioPackedBatch, split_segments
from encoders.config import AudioConfig, unit_tokens
from encoders.audio.mel import LogMelSpectrogram
from samples.checkpoints.tiny_towers import init_random_, tiny_audio_config
from encoders.weights import load_audio_encoder, read_prefixed, save_modules


def make_encoder(seed: int = 0, **overrides) -> AudioEncoder:
    return init_random_(AudioEncoder(tiny_audio_config(**overrides)), seed).eval()


@torch.no_grad()
def dense_segment_reference(enc: AudioEncoder, mel: torch.Tensor) -> torch.Tensor:
    """One segment, unpacked: plain convs, N x N masks, explicit pooling loops."""
    cfg = enc.config
    x = F.gelu(F.conv1d(mel.t()[None], enc.conv1.weight, enc.conv1.bias, padding=cfg.kernel_size // 2))
    x = F.gelu(F.conv1d(x, enc.conv2.weight, enc.conv2.bias, stride=cfg.stride_size,
                        padding=cfg.kernel_size // 2))[0].t()
    n, hd, nh = x.shape[0], cfg.head_dim, cfg.num_heads
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2) / hd)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    i = torch.arange(n)
    for layer, kind in zip(enc.layers, cfg.layer_types):
        att = layer.self_attn
        h = layer.self_attn_layer_norm(x)
        q, k, v = (p(h).view(n, nh, hd) for p in (att.q_proj, att.k_proj, att.v_proj))
        q, k = ((t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin) for t in (q, k))
        logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if kind == "sliding":
            logits = logits.masked_fill((i[:, None] - i[None, :]).abs() > cfg.attention_window, float("-inf"))
        x = x + att.out_proj(torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).reshape(n, -1))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    x = enc.layer_norm(x)
    pooled = torch.stack([x[j:j + cfg.avg_pooler].mean(0) for j in range(0, n, cfg.avg_pooler)])
    rows = list(pooled)
    while len(rows) % cfg.group_size:
        rows.append(rows[-1])
    groups = torch.stack(rows).reshape(-1, cfg.group_size * cfg.d_model)
    return enc.projection(groups)


@pytest.mark.parametrize("frames", [1, 2, 7, 33, 96])
def test_segment_matches_dense_reference(frames):
    enc = make_encoder()
    mel = torch.randn(frames, 32, generator=torch.Generator().manual_seed(frames))
    ours = enc.encode_segments([mel])[0]
    assert ours.shape == (enc.config.segment_tokens(frames), 48)
    torch.testing.assert_close(ours, dense_segment_reference(enc, mel), atol=2e-5, rtol=1e-4)


def test_sliding_window_matters():
    mel = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    a = make_encoder().encode_segments([mel])[0]
    b = make_encoder(attention_window=1000).encode_segments([mel])[0]
    assert (a - b).abs().max() > 1e-3


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 250), min_size=1, max_size=5), seed=st.integers(0, 100))
def test_packed_clips_equal_one_by_one(lengths, seed):
    enc = make_encoder(seed=1)
    g = torch.Generator().manual_seed(seed)
    mels = [torch.randn(n, 32, generator=g) for n in lengths]
    batched = enc(mels)
    for mel, out in zip(mels, batched):
        assert out.shape == (sum(unit_tokens("audio", (mel.shape[0],), audio=enc.config)), 48)
        torch.testing.assert_close(out, enc([mel])[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_segment_does_not_leak_into_its_neighbours(bad):
    """Segments of other requests packed around one whose log-mel holds NaN / Inf (a float WAV with
    a NaN sample, or samples so loud the mel overflows) come out as they do alone. The gaps between
    segments used to be zeroed by multiplying with a 0/1 mask after conv1, and NaN * 0 is NaN: the
    bad segment's conv1 spill into the gap reached its neighbours' conv2 taps."""
    enc = make_encoder(seed=4)
    g = torch.Generator().manual_seed(5)
    healthy = [torch.randn(n, 32, generator=g) for n in (37, 50, 96, 1)]
    alone = [enc.encode_segments([m])[0] for m in healthy]
    poisoned = torch.randn(40, 32, generator=g)
    poisoned[0, 3] = poisoned[-1, 7] = bad  # first and last frame: both gaps around it
    for where in range(len(healthy) + 1):
        segments = healthy[:where] + [poisoned] + healthy[where:]
        outs = enc.encode_segments(segments)
        rest = outs[:where] + outs[where + 1:]
        for ref, out in zip(alone, rest):
            assert torch.isfinite(out).all(), where
            assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), where


def test_long_audio_is_segments_encoded_independently():
    enc = make_encoder(seed=2)
    mel = torch.randn(96 * 3 + 41, 32, generator=torch.Generator().manual_seed(3))
    segs = split_segments(mel, 96)
    assert [s.shape[0] for s in segs] == [96, 96, 96, 41]
    whole = enc([mel])[0]
    # each segment alone (cacheable / streamable unit) == its slice of the whole clip
    parts = [enc.encode_segments([s])[0] for s in segs]
    torch.testing.assert_close(whole, torch.cat(parts), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(parts[1], dense_segment_reference(enc, segs[1]), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="exceeds segment_size"):
        AudioPackedBatch.build([mel], enc.config)


def test_token_counts_match_notes():
    cfg = AudioConfig()
    seconds_to_tokens = {1: 7, 10: 63, 30: 188, 60: 376}
    for s, tokens in seconds_to_tokens.items():
        assert sum(unit_tokens("audio", (cfg.num_mel_frames(s * cfg.sampling_rate),), audio=cfg)) == tokens
    assert cfg.num_mel_frames(24000) == 101 and cfg.frames_per_second == 100
    # segments: a 6000-frame segment gives 375 tokens, the remainder frame one more
    assert unit_tokens("audio", (6001,), audio=cfg) == (cfg.segment_tokens(6000), cfg.segment_tokens(1)) == (375, 1)


def test_log_mel_matches_manual_stft():
    cfg = tiny_audio_config()
    wave = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    mel = LogMelSpectrogram(cfg)(wave)
    assert mel.shape == (1 + 5000 // cfg.hop_length, cfg.n_mels)
    spec = torch.stft(wave, cfg.n_fft, cfg.hop_length, cfg.window_size, torch.hann_window(cfg.window_size),
                      center=True, pad_mode="reflect", return_complex=True).abs()
    fb = torchaudio.functional.melscale_fbanks(cfg.n_fft // 2 + 1, cfg.fmin, cfg.sampling_rate / 2, cfg.n_mels,
                                               cfg.sampling_rate, norm=None, mel_scale="htk")
    manual = torch.log(torch.clamp(spec.t() @ fb, min=1e-7))
    torch.testing.assert_close(mel, manual, atol=1e-4, rtol=1e-4)


def test_log_mel_mono_resample_and_short():
    cfg = tiny_audio_config()
    front = LogMelSpectrogram(cfg)
    stereo = torch.randn(2, 4800)
    torch.testing.assert_close(front(stereo), front(stereo.mean(0)))
    assert front(torch.randn(16000), sample_rate=16000).shape[0] == cfg.num_mel_frames(24000)
    assert front(torch.randn(50)).shape == (1, cfg.n_mels)
    with pytest.raises(ValueError, match="empty"):
        front(torch.zeros(0))


def test_checkpoint_round_trip(tmp_path):
    enc = make_encoder(seed=4)
    path = tmp_path / "audio.safetensors"
    save_modules(path, {"audio_encoder.": enc})
    names = set(read_prefixed(path, "audio_encoder.").keys())
    assert {"conv1.weight", "conv2.bias", "layers.0.self_attn.q_proj.bias", "layers.2.self_attn.out_proj.weight",
            "layers.1.fc1.weight", "layer_norm.weight", "projection.mlp.0.weight", "projection.mlp.2.weight"} <= names
    loaded = load_audio_encoder(enc.config, path)
    mel = torch.randn(70, 32)
    torch.testing.assert_close(loaded([mel])[0], enc([mel])[0], atol=0, rtol=0)


def test_bad_configs_and_inputs():
    with pytest.raises(ValueError, match="not divisible"):
        tiny_audio_config(num_heads=5)
    with pytest.raises(ValueError, match="unknown attention type"):
        tiny_audio_config(layer_types=("sliding", "causal", "full"))
    with pytest.raises(ValueError, match="entries for 3 layers"):
        tiny_audio_config(layer_types=("full",))
    with pytest.raises(ValueError, match=r"\[T>0, 32\]"):
        make_encoder().encode_segments([torch.zeros(10, 16)])
    cfg = AudioConfig.from_dict({"encoder_layers": 4, "swa_per_block": 2, "audio_n_mels": 64, "d_model": 128,
                                 "encoder_attention_heads": 2})
    assert cfg.layer_types == ("sliding", "full", "sliding", "full") and cfg.n_mels == 64
    assert AudioConfig.from_dict(cfg.to_dict()) == cfg


def test_real_rvq_audio_checkpoint_is_refused_clearly(tmp_path):
    from safetensors.torch import save_file

    from encoders.weights import UnsupportedAudioCheckpoint

    path = tmp_path / "real.safetensors"
    save_file({"audio_encoder.input_local_transformer.norm.weight": torch.ones(4),
               "audio_encoder.projection.mlp.0.weight": torch.ones(4, 4)}, str(path))
    with pytest.raises(UnsupportedAudioCheckpoint, match="RVQ audio path"):
        load_audio_encoder(tiny_audio_config(), path)


@pytest.mark.parametrize("samples", [1, 481, 482, 2400, 2401, 24000 * 3 + 17])
def test_log_mel_in_blocks_equals_the_whole_clip_stft(samples, monkeypatch):
    """The front end cuts a long clip's STFT into blocks of frames from one reflect-padded copy:
    every frame sees the samples it sees in torchaudio's centred whole-clip transform."""
    from encoders.audio import mel as mel_module

    cfg = AudioConfig()
    front = mel_module.LogMelSpectrogram(cfg)
    wave = torch.randn(samples, generator=torch.Generator().manual_seed(samples)) * 0.3
    padded = torch.nn.functional.pad(wave, (0, max(0, cfg.n_fft // 2 + 1 - samples)))
    whole = front._transform(wave.device)(padded)[:, :1 + samples // cfg.hop_length]
    expected = torch.log(torch.clamp(whole, min=mel_module.LOG_FLOOR)).transpose(0, 1)
    monkeypatch.setattr(mel_module, "BLOCK_FRAMES", 7)
    got = front(wave)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
