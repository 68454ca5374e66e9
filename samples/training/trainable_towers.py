"""Autograd-safe twins of the towers' per-layer math, bound onto a training copy of the towers.

The serving layers update activations in place (``x.add_``, in-place SiLU/softmax in the band
attention reference) -- right for inference, fatal for backward. :func:`make_trainable` rebinds
``forward`` of each ``VisionBlock`` / ``AudioEncoderLayer`` *instance* (the classes are untouched)
to the same math written out of place, with a masked attention per segment:

    packed rows   | seg 0 (n0) | seg 1 (n1) | ...         cu_seqlens = [0, n0, n0+n1, ...]
    -> padded     [S, Lmax, H, D], mask[s, i, j] = i, j < n_s and |i - j| <= window
    -> scaled_dot_product_attention, the per-head sink logit in the denominator (vision
       windowed blocks only); windowed layers in chunks so only the band is computed

Everything around the layers (patch embed, rotary, unit permutations, merger, conv front end,
pooling, projection) is the served code itself; tests/samples/test_demo_model.py compares both paths.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.encoder import AudioEncoder
from encoders.audio.blocks import AudioEncoderLayer
from encoders.rotary import apply_rotary
from encoders.vision.tower import VisionTransformer
from encoders.vision.blocks import VisionBlock
from samples.training.attention.band_chunks import chunk_rows, span_rows
from samples.training.attention.sink_key import sdpa_with_sinks


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


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                   scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Same contract as ``kernels.ops.band_attention`` (q [N, Hq, D], k/v [N, Hkv, D]) -> [N, Hq, Dv],
    with autograd, through ``F.scaled_dot_product_attention`` (no [S, H, L, L] float logits kept
    for backward: 3.6x faster than einsum + softmax on 400-patch images).

    A windowed layer only computes the band: queries in chunks of ``window`` rows, each against
    the ``3 * window`` keys that can reach it, so its cost is linear in the segment length instead
    of quadratic (:mod:`samples.training.attention.band_chunks`). Sinks enter as one extra key per head
    whose logit is the sink itself (:mod:`samples.training.attention.sink_key`) -- the served kernel's
    definition, exactly.
    """
    cu = [int(c) for c in cu_seqlens.tolist()]
    qp, valid, _ = _pad_segments(q, cu)               # [S, L, Hq, D]
    kp, _, _ = _pad_segments(k, cu)
    vp, _, _ = _pad_segments(v, cu)
    group = q.shape[1] // k.shape[1]
    kp = kp.repeat_interleave(group, dim=2)           # q head h uses kv head h // group
    vp = vp.repeat_interleave(group, dim=2)
    s_, length = qp.shape[:2]
    if window is None or 3 * window >= length:
        keys = torch.arange(length)
        allowed = valid[:, None, :].expand(-1, length, -1)                     # [S, Lq, Lk]
        if window is not None:
            allowed = allowed & ((keys[:, None] - keys[None, :]).abs() <= window)
        out = _sdpa(qp, kp, vp, allowed, scale, sinks)
        return out[valid]
    # Chunked band: queries in chunks of `window` rows, each with the keys within `window` of it.
    chunk = window
    qc = chunk_rows(qp, 1, chunk)                                              # [S, C, chunk, H, D]
    n_chunks = qc.shape[1]
    key_pos = torch.arange(n_chunks)[:, None] * chunk - window + torch.arange(chunk + 2 * window)[None]
    query_pos = torch.arange(n_chunks)[:, None] * chunk + torch.arange(chunk)[None]         # [C, chunk]
    near = (query_pos[:, :, None] - key_pos[:, None, :]).abs() <= window       # [C, chunk, span]
    allowed = span_rows(valid, 1, chunk, window, window)[:, :, None, :] & near[None]      # [S, C, chunk, span]
    kc, vc = (span_rows(x, 1, chunk, window, window) for x in (kp, vp))       # [S, C, span, H, D]
    out = _sdpa(qc.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), allowed.flatten(0, 1), scale, sinks)
    return out.unflatten(0, (s_, n_chunks)).flatten(1, 2)[:, :length][valid]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """[B, Lq, H, D] x [B, Lk, H, D] with ``allowed`` [B, Lq, Lk] -> [B, Lq, H, Dv] (float32 math)."""
    # A query row that may see nothing (padding) sees everything instead: it is dropped by the
    # caller, and an all-masked row would put NaN into the backward pass.
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))                 # [B, H, L, D]
    out = sdpa_with_sinks(qh, kh, vh, allowed[:, None], scale, sinks)
    return out.transpose(1, 2).to(v.dtype)


def _vision_block_forward(self: VisionBlock, x, cos, sin, cu_seqlens, window):
    attn, mlp = self.attn, self.mlp
    h = self.norm1(x)
    n = h.shape[0]
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = attn.qkv(h).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rotary(q.reshape(n, attn.num_heads, attn.head_dim), cos, sin)
    k = apply_rotary(k.reshape(n, attn.num_kv_heads, attn.head_dim), cos, sin)
    v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
    out = band_attention(q, k, v, cu_seqlens, scale=attn.scale, window=window, sinks=attn.sinks)
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
    out = band_attention(q, k, v, cu_seqlens, scale=attn.scale, window=window, sinks=None)
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
