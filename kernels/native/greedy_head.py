"""Wrapper of ``greedy_head.c``: the greedy token ids of a few rows straight from the LM head (fp32
CPU, the weight in kernel layout). An AVX-512 build never writes the logits; other builds (AVX2)
compute them with small_gemm.h's GEMM, in the same order of sums, and scan them.

:func:`lm_head_argmax` returns ``argmax(h @ w.T, dim=-1)`` as a list of ints, ties to the lowest id as
``torch.argmax``, or None when the C kernel cannot take the call (kernels off or not built, not fp32,
not CPU, the weight not column-major, odd strides) or when a logit is NaN (``torch.argmax`` then picks
the first NaN; the caller's torch path reproduces that). The model uses it only when every sampling
row of a step is greedy and asks for no logprobs (``Sampler.argmax_suffices``), and only for as many
rows as the build serves faster than MKL's GEMM + ``torch.argmax`` (:func:`pays`).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native.build import library

# Sampling rows for which the model asks for the fused head (MiMoV2ForCausalLM.greedy_ids): from 2 rows
# it beats MKL's GEMM + torch.argmax (8k x 256 head from memory, medians: 2 rows 0.55-0.71 vs 0.67-0.79
# ms, 4: 0.67 vs 1.24, 32: 1.70 vs 2.68); one row is MKL's GEMV at memory speed (0.44 vs 0.46-0.60 ms).
# A build without AVX-512 (AVX2: AMD Zen 2 / 3) pays from 2 rows while its GEMM streams the head (up to
# 8 rows; its tiles lose to MKL on a head this wide): greedy_head.c ``greedy_head_fast_rows``.
MIN_ROWS = 2
MAX_ROWS = 256  # past this (a prefill of many sampling rows, rare) the tiles have no edge left to show

_NAME = "greedy_head"
_FLAGS = ("-ffp-contract=fast",)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"lm_head_argmax_f32": ([_ptr, _i64, _i64, _ptr, _i64, _ptr], ctypes.c_int),
               "greedy_head_fast_rows": ([], ctypes.c_int)}


def _lib() -> ctypes.CDLL | None:
    return library(_NAME, flags=_FLAGS, signatures=_SIGNATURES)


def available() -> bool:
    """Whether the C kernel is on and built on this machine."""
    return _lib() is not None


def pays(rows: int) -> bool:
    """Whether ``rows`` sampling rows should take the C kernel: from ``MIN_ROWS`` to as many as this
    build serves faster than MKL's GEMM + ``torch.argmax`` (AVX-512: ``MAX_ROWS``; AVX2: 8)."""
    lib = _lib()
    return lib is not None and MIN_ROWS <= rows <= min(MAX_ROWS, lib.greedy_head_fast_rows())


def lm_head_argmax(h: torch.Tensor, w: torch.Tensor) -> list[int] | None:
    """h [R, K] fp32; w [N, K] fp32 column-major (``kernels.ops.linear_weight_layout``) -> the argmax
    id of each row of h w^T, or None (see the module docstring)."""
    if h.dtype is not torch.float32 or w.dtype is not torch.float32 or not (h.is_cpu and w.is_cpu):
        return None
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1] or not 0 < h.shape[0] <= MAX_ROWS:
        return None
    if w.shape[0] >= 2**31 or not (h.is_contiguous() and w.t().is_contiguous()):
        return None
    lib = _lib()
    if lib is None:
        return None
    rows, k = h.shape
    ids = torch.empty(rows, dtype=torch.int64)
    rc = lib.lm_head_argmax_f32(h.data_ptr(), rows, k, w.data_ptr(), w.shape[0], ids.data_ptr())
    if rc == -2:
        raise MemoryError(f"lm_head_argmax: no memory for the transposed rows of {rows} x {k}")
    if rc:
        return None  # 1: a NaN logit (torch picks the first NaN)
    return ids.tolist()
