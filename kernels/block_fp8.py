"""BlockFP8: a stack of weights kept the way block-FP8 checkpoints store them, for the expert kernels.

MiMo-V2 / DeepSeek-V3 checkpoints store each expert weight W [N, K] as e4m3 values and one fp32
factor per (bn x bk) block, ``weight_scale_inv``, multiplied back: W ~= values * scale_inv. Kept that
way in memory (1 byte a weight plus 4 bytes per block) instead of dequantised at load (2 bytes in bf16),
the experts -- nearly all of MiMo-V2.5's ~310 B parameters -- take half the memory, and a decode
step, which reads every routed expert's weights once, reads half the bytes. The Triton expert kernels
multiply each weight tile by its block's factor after loading it (kernels/moe_triton.py); everywhere
else (CPU, references) the stack is dequantised first.

A stack may hold ``groups`` row groups blocked on their own: the fused gate/up stack [E, 2I, H] puts
the gate rows, then the up rows, each quantised as its own [I, H] weight, so its scale has
2 * ceil(I / bn) rows (the up group's first at ceil(I / bn)), not ceil(2I / bn):

    values     [E, N, K]  float8_e4m3fn         N = groups * n      (n rows per group)
    scale_inv  [E, groups * ceil(n / bn), ceil(K / bk)]  fp32
    row r of group g (r in [0, n)) and column c read scale_inv[e, g * ceil(n / bn) + r // bn, c // bk]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gpu_reads_e4m3(device: torch.device | str) -> bool | None:
    """Whether the Triton kernels can read e4m3 values on this CUDA device: compute capability 8.9
    or newer (Ada, Hopper, Blackwell); Triton refuses the type on older GPUs (A100 sm_80, A10 sm_86).
    None: not a CUDA device (the CPU paths dequantise instead)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device) >= (8, 9)


def dequantize_blocks(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., N, K] * their per-block scale_inv [..., ceil(N/bn), ceil(K/bk)] -> ``dtype`` [..., N, K]."""
    bn, bk = block
    n, k = values.shape[-2:]
    full = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (values.float() * full).to(dtype)


@dataclass(frozen=True)
class BlockFP8:
    """A stacked block-FP8 weight (see the module docstring); built per call from a module's tensors."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    groups: int = 1

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def group_rows(self) -> int:
        """Rows of one group (n)."""
        return self.values.shape[-2] // self.groups

    @property
    def group_scale_rows(self) -> int:
        """Scale rows of one group: the first scale row of group g is g times this."""
        return _cdiv(self.group_rows, self.block[0])

    def check(self, name: str) -> None:
        """Raise ValueError naming ``name`` unless values, scales and blocks agree."""
        v, s, (bn, bk) = self.values, self.scale_inv, self.block
        if v.dtype != FP8_DTYPE or s.dtype != torch.float32:
            raise ValueError(f"{name}: block-FP8 values must be {FP8_DTYPE} and scales float32, got {v.dtype}, {s.dtype}")
        if bn < 1 or bk < 1 or self.groups < 1 or v.shape[-2] % self.groups:
            raise ValueError(f"{name}: bad blocks {self.block} / groups {self.groups} for shape {tuple(v.shape)}")
        want = (*v.shape[:-2], self.groups * self.group_scale_rows, _cdiv(v.shape[-1], bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: scale_inv shape {tuple(s.shape)}, expected {want} for values "
                             f"{tuple(v.shape)} in {self.block} blocks ({self.groups} row groups)")
        if s.device != v.device:
            raise ValueError(f"{name}: scale_inv on {s.device}, values on {v.device}")
        if s.stride(-1) != 1:  # the kernels step along a scale row by 1 (no stride of its own)
            raise ValueError(f"{name}: scale_inv must be contiguous in its last dim")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stack in ``dtype`` (every group dequantised with its own scale rows)."""
        n, sn = self.group_rows, self.group_scale_rows
        parts = [dequantize_blocks(self.values[..., g * n:(g + 1) * n, :], self.scale_inv[..., g * sn:(g + 1) * sn, :],
                                   self.block, dtype) for g in range(self.groups)]
        return parts[0] if self.groups == 1 else torch.cat(parts, dim=-2)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int], groups: int = 1) -> BlockFP8:
        """Quantise a float stack [..., N, K]: per (bn x bk) block of each group, amax / 448 (e4m3's
        largest value) as its factor, values rounded to e4m3."""
        n = w.shape[-2] // groups
        if w.shape[-2] % groups:
            raise ValueError(f"{w.shape[-2]} rows do not split into {groups} groups")
        vals, scales = zip(*(_quantize(w[..., g * n:(g + 1) * n, :], block) for g in range(groups)))
        return cls(torch.cat(vals, dim=-2), torch.cat(scales, dim=-2), block, groups)


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    *lead, n, k = w.shape
    rows, cols = _cdiv(n, bn), _cdiv(k, bk)
    padded = w.float().new_zeros(*lead, rows * bn, cols * bk)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / E4M3_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.view(*lead, rows * bn, cols * bk)[..., :n, :k].to(FP8_DTYPE).contiguous(), scale.contiguous()
