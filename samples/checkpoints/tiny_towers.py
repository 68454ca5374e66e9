"""Small encoder configs and a deterministic random init, for tests, benchmarks and tiny checkpoints.

The random init keeps activations O(1) through any depth (fan-in scaled weights, norms near 1, small
biases, sink logits ~ N(0, 1)) so equivalence tests compare meaningful numbers, not saturated ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encoders.audio.mimo_config import AudioTokenizerConfig, SpeechInputConfig
from encoders.config import AudioConfig, VisionConfig


def tiny_vision_config(**overrides) -> VisionConfig:
    """5 blocks exercising every transition: full -> row -> col -> full -> col (ends in column order)."""
    base = dict(depth=5, hidden_size=64, intermediate_size=96, num_heads=4, num_key_value_heads=2, head_dim=16,
                out_hidden_size=48, fullatt_block_indexes=(0, 3), vit_window_attn_types=(-1, 0, 1, -1, 1),
                window=6, use_sink=True)
    base.update(overrides)
    return VisionConfig(**base)


def tiny_audio_config(**overrides) -> AudioConfig:
    base = dict(n_mels=32, d_model=64, num_layers=3, num_heads=4, ffn_dim=96,
                layer_types=("sliding", "full", "sliding"), attention_window=5, segment_size=96,
                projection_hidden_size=80, out_hidden_size=48)
    base.update(overrides)
    return AudioConfig(**base)


def tiny_tokenizer_config(**overrides) -> AudioTokenizerConfig:
    """The MiMo-V2.5 audio tokenizer scaled down: 4 layers (sliding, full, sliding, full with a
    3-frame window), skip after layer 2, 4 RVQ stages of mixed sizes like the real [1024, 1024, 256, 128...]."""
    base = dict(n_mels=32, d_model=32, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=48,
                encoder_skip_layer_id=2, window=3, codebook_size=(16, 16, 8, 8))
    base.update(overrides)
    return AudioTokenizerConfig(**base)


def tiny_speech_config(**overrides) -> SpeechInputConfig:
    """The main checkpoint's audio_config scaled down: 4 channels, vocab 20 (> every codebook), a
    2-layer local transformer of width 32."""
    base = dict(audio_channels=4, group_size=4, speech_vocab_size=(20,) * 4, input_local_dim=32,
                input_local_layers=2, input_local_attn_heads=4, input_local_head_dim=8,
                input_local_intermediate_size=48, projection_hidden_size=64, out_hidden_size=48)
    base.update(overrides)
    return SpeechInputConfig(**base)


@torch.no_grad()
def init_random_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic in-place init of every parameter (by name order, independent of device)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sinks":
            value = torch.randn(p.shape, generator=gen)
        elif leaf == "bias":
            value = 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:  # norm weights
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = math.prod(p.shape[1:])
            value = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
        p.copy_(value.to(p.dtype))
    for name, b in sorted(module.named_buffers()):
        if name.endswith("_codebook.embed"):  # RVQ codebooks: rows on the scale of normed features
            b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
    return module
