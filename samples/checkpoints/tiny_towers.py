"""Small encoder configs and a deterministic random init, for tests, benchmarks and tiny checkpoints.

The random init keeps activations O(1) through any depth (fan-in scaled weights, norms near 1, small
biases, sink logits ~ N(0, 1)) so equivalence tests compare meaningful numbers, not saturated ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

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
    return module
