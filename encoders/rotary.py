"""Rotary position embeddings for the encoders: 2-D (vision patches) and 1-D (audio frames).

Both use NeoX rotate-half over the whole head: pairs (i, i + D/2).

Vision (docs/model.md §3): head_dim D -> D/4 inverse frequencies ``theta^(-2j/(D/2))``; a patch at
(h, w) gets the angle vector

    [ h*f_0 .. h*f_{D/4-1} | w*f_0 .. w*f_{D/4-1} ]   (D/2 angles)  duplicated -> D

so the first half of every rotated pair carries the row and the second the column coordinate.
"""

from __future__ import annotations

import torch


def inverse_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """``theta^(-2j/rotary_dim)`` for j < rotary_dim/2 (float32)."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)


def vision_patch_coordinates(grid_thw: tuple[int, int, int], merge: int, device=None) -> torch.Tensor:
    """(h, w) of every patch token, in the processor's merge-unit-major row order -> [t*gh*gw, 2].

        frame:  unit (0,0)   unit (0,1)  ...      token order inside a unit (merge 2):
                 0 1 | 4 5                             0 1
                 2 3 | 6 7                             2 3
    """
    t, gh, gw = grid_thw
    hb = torch.arange(gh // merge, device=device).view(-1, 1, 1, 1) * merge
    wb = torch.arange(gw // merge, device=device).view(1, -1, 1, 1) * merge
    hi = torch.arange(merge, device=device).view(1, 1, -1, 1)
    wi = torch.arange(merge, device=device).view(1, 1, 1, -1)
    shape = (gh // merge, gw // merge, merge, merge)
    h = (hb + hi).expand(shape).reshape(-1)
    w = (wb + wi).expand(shape).reshape(-1)
    return torch.stack([h, w], dim=-1).repeat(t, 1)


def vision_rotary(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [N, head_dim] (float32) for patch coordinates [N, 2]; see :func:`apply_rotary`."""
    inv = inverse_frequencies(head_dim // 2, theta, device=coords.device)  # D/4 frequencies
    angles = (coords.to(torch.float32)[:, :, None] * inv[None, None, :]).reshape(coords.shape[0], -1)
    return _cos_signed_sin(angles)


def rotary_1d(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [N, head_dim] (float32) for integer positions [N]."""
    inv = inverse_frequencies(head_dim, theta, device=positions.device)
    return _cos_signed_sin(positions.to(torch.float32)[:, None] * inv[None, :])


def _cos_signed_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width angles [N, D/2] -> cos [N, D] and sin with rotate-half's sign folded in:
    rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated (NeoX rotate-half) by cos / signed sin [N, D]; computed in float32."""
    dtype = x.dtype
    x = x.float()
    out = torch.addcmul(x * cos[:, None, :], torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin[:, None, :])
    return out.to(dtype)
