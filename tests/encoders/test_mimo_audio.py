"""The MiMo-V2.5 reference audio path, stage by stage against plain references written here: mel vs
torchaudio, the tokenizer encoder vs an explicit loop (both attention readings), RVQ vs a
brute-force loop, the local transformer vs transformers' Qwen2Model with the same weights and a
bidirectional mask; grouping, codes input, token counts per duration (docs/model.md §4), and the
tiny checkpoint in the real tensor layout (§2.4)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import torchaudio
from safetensors import safe_open

from encoders.audio.mel import LogMelSpectrogram
from encoders.audio.mimo_audio import MimoAudioEncoder
from encoders.audio.mimo_config import AudioTokenizerConfig, SpeechInputConfig
from encoders.audio.rvq_tokenizer import AudioTokenizerEncoder
from encoders.audio.speech_input import SpeechInput
from encoders.config import AudioConfig, unit_tokens
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
from samples.checkpoints.tiny_towers import (init_random_, tiny_audio_config, tiny_speech_config,
                                             tiny_tokenizer_config)

pytestmark = pytest.mark.usefixtures("one_thread")


def tokenizer(seed: int = 0, **over) -> AudioTokenizerEncoder:
    return init_random_(AudioTokenizerEncoder(tiny_tokenizer_config(**over)), seed).eval()


# ---- front end and token counts -------------------------------------------------------------------
def test_mel_matches_torchaudio_with_the_reference_settings():
    cfg = AudioConfig()  # the real front end: 24 kHz, n_fft 960, hop 240, 128 HTK mels, magnitude
    wave = torch.randn(24000 // 2 + 17, generator=torch.Generator().manual_seed(0))
    ref = torchaudio.transforms.MelSpectrogram(sample_rate=24000, n_fft=960, win_length=960, hop_length=240,
                                               f_min=0.0, f_max=None, n_mels=128, power=1.0, center=True,
                                               pad_mode="reflect", norm=None, mel_scale="htk")(wave)
    ref = torch.log(torch.clamp(ref, min=1e-7)).t()
    got = LogMelSpectrogram(cfg)(wave)
    assert got.shape == (1 + wave.numel() // 240, 128) == ref.shape
    torch.testing.assert_close(got, ref)
    silent = LogMelSpectrogram(cfg)(torch.zeros(2400))
    assert torch.all(silent == math.log(1e-7))  # the clamp floor


@pytest.mark.parametrize("seconds,tokens", [(1, 7), (10, 63), (30, 188), (60, 376)])
def test_token_counts_per_duration(seconds, tokens):
    cfg = AudioConfig()  # segment 6000 frames, stride 2, pool 2, group 4
    frames = cfg.num_mel_frames(seconds * 24000)
    assert sum(unit_tokens("audio", (frames,), audio=cfg)) == tokens


@pytest.mark.parametrize("frames", [1, 2, 3, 5, 8, 31, 96])
def test_rows_per_segment_follow_the_one_token_rule(frames):
    front = tiny_audio_config()
    enc = MimoAudioEncoder(front, tiny_tokenizer_config(), tiny_speech_config())
    init_random_(enc, 1).eval()
    (rows,) = enc.encode_segments([torch.randn(frames, front.n_mels)])
    assert rows.shape == (front.segment_tokens(frames), 48)


# ---- tokenizer encoder ----------------------------------------------------------------------------
@torch.no_grad()
def plain_features(enc: AudioTokenizerEncoder, mel: torch.Tensor, mode: str) -> torch.Tensor:
    """One segment with explicit convs, an N x N mask from nested loops and a manual softmax."""
    cfg = enc.config
    x = F.gelu(F.conv1d(mel.t()[None], enc.conv1.weight, enc.conv1.bias, padding=1))
    x = F.gelu(F.conv1d(x, enc.conv2.weight, enc.conv2.bias, stride=2, padding=1))[0].t()
    n, hd, nh = x.shape[0], cfg.head_dim, cfg.encoder_attention_heads
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2) / hd)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    skip = None
    for li, layer in enumerate(enc.layers):
        allowed = torch.ones(n, n, dtype=torch.bool)
        if mode == "reference":  # causal everywhere; even layers also see only `window` frames back
            for i in range(n):
                for j in range(n):
                    allowed[i, j] = j <= i and (li % 2 == 1 or i - j <= cfg.window)
        att = layer.self_attn
        h = layer.self_attn_layer_norm(x)
        q, k, v = (p(h).view(n, nh, hd) for p in (att.q_proj, att.k_proj, att.v_proj))
        q, k = ((t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin) for t in (q, k))
        logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        logits = logits.masked_fill(~allowed, float("-inf"))
        x = x + att.out_proj(torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).reshape(n, -1))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        if li + 1 == cfg.encoder_skip_layer_id:
            skip = x.clone()
    x = enc.layer_norm(x + skip)
    if n % 2:
        x = torch.cat([x, torch.zeros(1, x.shape[1])])
    x = F.gelu(F.conv1d(x.t()[None], enc.down_sample_layer[0].weight, stride=2))[0].t()
    return enc.down_sample_norm(x)


@pytest.mark.parametrize("mode", ["reference", "bidirectional"])
def test_tokenizer_features_match_plain_reference(mode):
    enc = tokenizer(tokenizer_attention=mode)
    mels = [torch.randn(n, 32, generator=torch.Generator().manual_seed(n)) for n in (37, 16, 5)]
    batched = enc.features(mels)  # one packed forward
    for mel, got in zip(mels, batched):
        ref = plain_features(enc, mel, mode)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(enc.features([mel])[0], ref, atol=2e-5, rtol=1e-4)


def test_the_two_attention_readings_differ_and_the_window_is_causal():
    ref, bi = tokenizer(tokenizer_attention="reference"), tokenizer(tokenizer_attention="bidirectional")
    bi.load_state_dict(ref.state_dict())
    mel = torch.randn(40, 32)
    assert not torch.allclose(ref.features([mel])[0], bi.features([mel])[0], atol=1e-3)
    # causal: a frame appended at the end leaves the earlier conv rows' features unchanged under the
    # reference reading (the last conv row and the downsample pair it lands in aside)
    longer = torch.cat([mel, torch.randn(8, 32)])
    a, b = ref.features([mel])[0], ref.features([longer])[0]
    torch.testing.assert_close(a[:-2], b[:a.shape[0] - 2], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(bi.features([mel])[0][:-2], bi.features([longer])[0][:a.shape[0] - 2], atol=1e-3)
    assert AudioTokenizerConfig().layer_attention()[:3] == ((True, 128), (True, None), (True, 128))
    assert set(AudioTokenizerConfig(tokenizer_attention="bidirectional").layer_attention()) == {(False, None)}


# ---- RVQ ------------------------------------------------------------------------------------------
def test_rvq_matches_brute_force_loop():
    enc = tokenizer(seed=2)
    feats = torch.randn(30, 32, generator=torch.Generator().manual_seed(5))
    books = [s._codebook.embed.to(torch.bfloat16).float() for s in enc.quantizer.vq.layers]
    expected = torch.zeros(30, len(books), dtype=torch.long)
    for t in range(30):
        residual = feats[t].clone()
        for q, book in enumerate(books):
            best, best_d = -1, float("inf")
            for c in range(book.shape[0]):
                d = float(((residual - book[c]) ** 2).sum())
                if d < best_d:
                    best, best_d = c, d
            expected[t, q] = best
            residual = residual - book[best]
    assert torch.equal(enc.quantizer.encode(feats), expected)


def test_rvq_quantizes_against_bf16_rounded_codebooks():
    enc = tokenizer(seed=2)
    stage = enc.quantizer.vq.layers[0]._codebook.embed
    stage.copy_(stage + 1e-4 * torch.randn_like(stage))  # values bf16 cannot hold
    rounded = stage.to(torch.bfloat16).float()
    assert not torch.equal(rounded, stage)
    assert torch.equal(enc.quantizer.codebooks()[0], rounded)
    # a feature exactly on a rounded row picks that row at stage 0
    assert enc.quantizer.encode(rounded[3:4] * 1.0)[0, 0] == 3


# ---- codes -> embeddings ----------------------------------------------------------------------------
def test_grouping_repeats_the_last_row_and_keeps_the_first_channels():
    speech = init_random_(SpeechInput(tiny_speech_config()), 0)
    codes = torch.randint(0, 8, (5, 6))  # 6 channels given, 4 used
    grouped = speech.group_codes(codes)
    assert grouped.shape == (2, 4, 4)
    assert torch.equal(grouped.reshape(8, 4)[:5], codes[:, :4])
    assert torch.equal(grouped.reshape(8, 4)[5:], codes[4:5, :4].expand(3, 4))
    with pytest.raises(ValueError, match=r"\[T>0, >=4\]"):
        speech.group_codes(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="channel 1 must be in"):
        speech.group_codes(torch.tensor([[0, 20, 0, 0]]))


@torch.no_grad()
def test_local_transformer_matches_qwen2_with_a_bidirectional_mask():
    from transformers import Qwen2Config, Qwen2Model

    cfg = tiny_speech_config()
    speech = init_random_(SpeechInput(cfg), 3).eval()
    local = speech.audio_encoder.input_local_transformer
    qcfg = Qwen2Config(vocab_size=4, hidden_size=cfg.input_local_dim, num_hidden_layers=cfg.input_local_layers,
                       num_attention_heads=cfg.input_local_attn_heads, num_key_value_heads=cfg.input_local_attn_heads,
                       head_dim=cfg.input_local_head_dim, intermediate_size=cfg.input_local_intermediate_size,
                       rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, attn_implementation="eager")
    qwen = Qwen2Model(qcfg).eval()
    missing, unexpected = qwen.load_state_dict(local.state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    x = torch.randn(5, cfg.group_size, cfg.input_local_dim)
    everyone = torch.ones(5, 1, cfg.group_size, cfg.group_size, dtype=torch.bool)  # bidirectional
    ref = qwen(inputs_embeds=x, attention_mask=everyone).last_hidden_state
    torch.testing.assert_close(local(x), ref, atol=1e-5, rtol=1e-4)
    causal = qwen(inputs_embeds=x).last_hidden_state
    assert not torch.allclose(local(x), causal, atol=1e-3)  # the mask matters: it is not causal

    # the whole codes -> embedding chain: sum of per-channel embeddings, Qwen2, projection
    codes = torch.randint(0, 16, (7, cfg.audio_channels))
    grouped = speech.group_codes(codes)
    summed = sum(speech.speech_embeddings[c].weight[grouped[..., c]] for c in range(cfg.audio_channels))
    hidden = qwen(inputs_embeds=summed, attention_mask=torch.ones(2, 1, 4, 4, dtype=torch.bool)).last_hidden_state
    proj = speech.audio_encoder.projection.mlp
    expected = proj[2].weight @ F.gelu(proj[0].weight @ hidden.reshape(2, -1).t())
    torch.testing.assert_close(speech(grouped), expected.t(), atol=1e-5, rtol=1e-4)


# ---- the checkpoint in the real layout -------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("ref") / "m", seed=4, audio_path="reference")


def test_tiny_checkpoint_has_the_real_tensor_layout(ckpt):
    with safe_open(str(ckpt / "model-encoders.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    s = tiny_speech_config(out_hidden_size=64)
    d, g = s.input_local_dim, s.group_size
    assert shapes["speech_embeddings.3.weight"] == (20, d)
    assert "speech_embeddings.4.weight" not in shapes
    lt = "audio_encoder.input_local_transformer."
    assert shapes[lt + "layers.1.self_attn.q_proj.bias"] == (d,)
    assert shapes[lt + "layers.0.self_attn.o_proj.weight"] == (d, d) and lt + "layers.0.self_attn.o_proj.bias" not in shapes
    assert shapes[lt + "layers.0.mlp.gate_proj.weight"] == (48, d)
    assert shapes[lt + "norm.weight"] == (d,)
    assert shapes["audio_encoder.projection.mlp.0.weight"] == (64, g * d)
    assert shapes["audio_encoder.projection.mlp.2.weight"] == (64, 64)
    with safe_open(str(ckpt / "audio_tokenizer" / "model.safetensors"), "pt") as f:
        tok = set(f.keys())
    assert {"encoder.conv1.weight", "encoder.conv2.bias", "encoder.layers.3.self_attn.out_proj.bias",
            "encoder.layers.0.self_attn_layer_norm.weight", "encoder.layers.0.final_layer_norm.bias",
            "encoder.layers.0.fc1.weight", "encoder.layer_norm.weight", "encoder.down_sample_layer.0.weight",
            "encoder.down_sample_norm.weight", "encoder.quantizer.vq.layers.3._codebook.embed"} <= tok
    assert json.loads((ckpt / "audio_tokenizer" / "config.json").read_text())["codebook_size"] == [16, 16, 8, 8]


def test_checkpoint_selects_the_reference_path_and_encodes(ckpt):
    from mm_pipeline.model.config import OmniConfig
    from mm_pipeline.model.omni_model import OmniModel

    assert OmniConfig.from_pretrained(ckpt).audio_path == "reference"
    model = OmniModel.load(ckpt)
    assert isinstance(model.audio, MimoAudioEncoder)
    mel = torch.randn(150, 32)
    segments = [mel[:96], mel[96:]]
    rows = model.audio.encode_segments(segments)
    assert [r.shape for r in rows] == [(6, 64), (4, 64)]
    for seg, r in zip(segments, rows):  # batched == one by one
        torch.testing.assert_close(model.audio.encode_segments([seg])[0], r, atol=1e-5, rtol=1e-4)
    # pre-tokenized codes give the same rows as the mel path
    codes = model.audio.tokenize_segments(segments[:1])[0]
    assert codes.shape == (24, 4)
    torch.testing.assert_close(model.audio.encode_codes(codes), rows[0], atol=1e-6, rtol=1e-5)
    other = OmniModel.load(ckpt, audio_tokenizer_attention="bidirectional")
    assert other.encoder_id != model.encoder_id  # cached rows of one reading never serve the other
    assert not torch.allclose(other.audio.encode_segments(segments[:1])[0], rows[0], atol=1e-4)


def test_loader_fills_a_missing_k_bias_and_skips_training_buffers(ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from encoders.weights import load_mimo_audio_encoder
    from mm_pipeline.model.config import OmniConfig

    copy = tmp_path / "m"
    shutil.copytree(ckpt, copy)
    path = copy / "audio_tokenizer" / "model.safetensors"
    state = load_file(str(path))
    state = {k: v for k, v in state.items() if k != "encoder.layers.1.self_attn.k_proj.bias"}
    state["encoder.quantizer.vq.layers.0._codebook.cluster_size"] = torch.ones(16)
    state["encoder.quantizer.vq.layers.0._codebook.inited"] = torch.ones(1)
    save_file(state, str(path))
    cfg = OmniConfig.from_pretrained(copy)
    enc = load_mimo_audio_encoder(cfg.audio, cfg.speech, copy)
    assert torch.equal(enc.tokenizer.layers[1].self_attn.k_proj.bias, torch.zeros(32))
    (copy / "audio_tokenizer" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="audio_tokenizer/config.json"):
        load_mimo_audio_encoder(cfg.audio, cfg.speech, copy)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tokenizer_attention"):
        AudioTokenizerConfig(tokenizer_attention="sideways")
    with pytest.raises(ValueError, match="speech vocab sizes"):
        SpeechInputConfig(audio_channels=3, speech_vocab_size=(20, 20))
    with pytest.raises(ValueError, match="disagrees"):
        MimoAudioEncoder(tiny_audio_config(), tiny_tokenizer_config(n_mels=16), tiny_speech_config())
    with pytest.raises(ValueError, match="smaller than their codebooks"):
        MimoAudioEncoder(tiny_audio_config(), tiny_tokenizer_config(), tiny_speech_config(speech_vocab_size=(8,) * 4))
    real = SpeechInputConfig.from_dict({"audio_channels": 20, "speech_vocab_size": "1280", "input_local_layers": 6,
                                        "out_hidden_size": 4096})
    assert real.speech_vocab_size == (1280,) * 20 and real.projection_hidden_size == 16384
    dashed = SpeechInputConfig.from_dict({"audio_channels": 3, "speech_vocab_size": "1025-1025-129"})
    assert dashed.speech_vocab_size == (1025, 1025, 129)
    tok = AudioTokenizerConfig.from_dict({"encoder_attn_window_size": [128, 0], "codebook_size": [1024, 1024, 256]
                                          + [128] * 17, "num_quantizers": 20})
    assert tok.num_quantizers == 20 and tok.window == 128
