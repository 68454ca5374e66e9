"""Autograd-safe twins of the towers' per-layer math, bound onto a training copy of the towers.

The serving layers update activations in place (``x.add_``, in-place SiLU/softmax in the band
attention reference) -- right for inference, fatal for backward. :func:`make_trainable` rebinds
``forward`` of each ``VisionBlock`` / ``AudioEncoderLayer`` *instance* (the classes are untouched)
to the same math written out of place, with a dense masked attention per segment:

    packed rows   | seg 0 (n0) | seg 1 (n1) | ...         cu_seqlens = [0, n0, n0+n1, ...]
    -> padded     [S, Lmax, H, D], mask[s, i, j] = i, j < n_s and |i - j| <= window
    -> softmax with the per-head sink logit in the denominator (vision windowed blocks only)

Everything around the layers (patch embed, rotary, unit permutations, merger, conv front end,
pooling, projection) is the served code itself; tests/test_demo_model.py compares both paths.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio import AudioEncoder
from encoders.audio_blocks import AudioEncoderLayer
from encoders.rotary import apply_rotary
from encoders.vision import VisionTransformer
from encoders.vision_blocks import VisionBlock


def _pad_segments(x: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, ...] -> padded [S, Lmax, ...], valid [S, Lmax] bool, gather index of the valid rows."""
    lens = [b - a for a, b in zip(cu, cu[1:])]
    lmax = max(lens)
    idx = torch.full((len(lens), lmax), -1, dtype=torch.long)
    for s, (a, n) in enumerate(zip(cu, lens)):
        idx[s, :n] = torch.arange(a, a + n)
    valid = idx >= 0
    padded = x[idx.clamp(min=0)]
    return padded, valid, idx


def dense_band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                         scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Same contract as ``kernels.ops.band_attention`` (q [N, Hq, D], k/v [N, Hkv, D]) -> [N, Hq, Dv]."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    qp, valid, idx = _pad_segments(q, cu)             # [S, L, Hq, D]
    kp, _, _ = _pad_segments(k, cu)
    vp, _, _ = _pad_segments(v, cu)
    group = q.shape[1] // k.shape[1]
    kp = kp.repeat_interleave(group, dim=2)           # q head h uses kv head h // group
    vp = vp.repeat_interleave(group, dim=2)
    logits = torch.einsum("sihd,sjhd->shij", qp.float(), kp.float()) * scale
    pos = torch.arange(qp.shape[1])
    mask = valid[:, None, :].expand(-1, qp.shape[1], -1)
    if window is not None:
        mask = mask & ((pos[:, None] - pos[None, :]).abs() <= window)[None]
    # Padding query rows see every key: they are dropped below, and an all -inf row would put NaN
    # into the backward pass.
    mask = mask | ~valid[:, :, None]
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("shij,sjhd->sihd", probs, vp.float()).to(v.dtype)
    return out[valid]  # rows in packed order: segments are contiguous and in order


def _vision_block_forward(self: VisionBlock, x, cos, sin, cu_seqlens, window):
    attn, mlp = self.attn, self.mlp
    h = self.norm1(x)
    n = h.shape[0]
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = attn.qkv(h).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rotary(q.reshape(n, attn.num_heads, attn.head_dim), cos, sin)
    k = apply_rotary(k.reshape(n, attn.num_kv_heads, attn.head_dim), cos, sin)
    v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
    out = dense_band_attention(q, k, v, cu_seqlens, scale=attn.scale, window=window, sinks=attn.sinks)
    x = x + attn.proj(out.reshape(n, q_size))
    h = self.norm2(x)
    return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def _audio_layer_forward(self: AudioEncoderLayer, x, cos, sin, cu_seqlens, window):
    attn = self.self_attn
    h = self.self_attn_layer_norm(x)
    n = h.shape[0]
    shape = (n, attn.num_heads, attn.head_dim)
    q = apply_rotary(attn.q_proj(h).view(shape), cos, sin)
    k = apply_rotary(attn.k_proj(h).view(shape), cos, sin)
    v = attn.v_proj(h).view(shape)
    out = dense_band_attention(q, k, v, cu_seqlens, scale=attn.scale, window=window, sinks=None)
    x = x + attn.out_proj(out.reshape(n, -1))
    return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def make_trainable(module: nn.Module) -> nn.Module:
    """Rebind every vision block / audio layer of ``module`` to its out-of-place twin (in place)."""
    for sub in module.modules():
        if isinstance(sub, VisionBlock):
            sub.forward = types.MethodType(_vision_block_forward, sub)
        elif isinstance(sub, AudioEncoderLayer):
            sub.forward = types.MethodType(_audio_layer_forward, sub)
    return module


def vision_forward(vision: VisionTransformer, batch) -> torch.Tensor:
    """The tower's ``forward_packed`` body with gradients (its public forward is no_grad)."""
    return type(vision).forward_packed.__wrapped__(vision, batch)


def audio_forward(audio: AudioEncoder, batch) -> torch.Tensor:
    return type(audio).forward_packed.__wrapped__(audio, batch)
