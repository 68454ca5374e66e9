"""Wrapper of ``mtp_draft.c``: an MTP layer's k greedy draft steps for B requests in one C call (fp32 CPU).

:class:`DraftKernel` holds one weight version of the layer folded into kernel layout (built by
llm_core/engine/speculative/fused_draft.py, which tracks the versions) and :meth:`DraftKernel.draft`
runs the steps, reading the window's cached K/V straight from the SWA pool through the requests'
page tables. Either returns None when the C kernel cannot serve (kernels off or not built, not fp32,
not CPU, shapes that do not fit); the caller then keeps its torch path. A released page under the
window or a slot past the pool's end raises, as the torch path does, before anything is read.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native.build import library

_NAME = "mtp_draft"
_FLAGS = ("-ffp-contract=fast",)  # FMA in the projections, like decoder_layer.c
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Shape(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("B", "K", "H", "Hq", "Hkv", "D", "Dv", "I", "V", "W", "R", "rows")] + [
        ("eps", ctypes.c_float)]


_WEIGHT_NAMES = ("table", "w_h", "norm_in", "w_qkv", "w_o", "norm_mlp", "w_gu", "w_down", "norm_final", "lm_head",
                 "sinks")


class _Weights(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in _WEIGHT_NAMES]


_SIGNATURES = {"mtp_draft_f32": ([ctypes.POINTER(_Shape), ctypes.POINTER(_Weights), _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                                  _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr],
                                 ctypes.c_int)}


def _lib() -> ctypes.CDLL | None:
    return library(_NAME, flags=_FLAGS, signatures=_SIGNATURES)


def available() -> bool:
    """Whether the C kernel is on and built on this machine (builds it on first use)."""
    return _lib() is not None


def _longs(values: list[int]) -> ctypes.Array:
    return (_i64 * max(len(values), 1))(*values)


class DraftKernel:
    """One weight version of an MTP layer in kernel layout (W^T [in][out] row-major, small_gemm.h):

        table [V, H]       eh_proj_e @ enorm(embed[t])      w_h [H, H]     (eh_proj_h * hnorm)^T
        w_qkv [H, N]       q rows * scale, v rows * value scale (N = (Hq + Hkv) D + Hkv Dv)
        w_o [Hq Dv, H]     w_gu [H, 2I] (gate, then up)     w_down [I, H]  lm_head [H, V]
        norm_in / norm_mlp / norm_final [H], sinks [Hq] or None
    """

    def __init__(self, weights: dict[str, torch.Tensor | None], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, rotary_dim: int, window: int, eps: float) -> None:
        self.tensors = {n: (None if t is None else t.contiguous()) for n, t in weights.items()}
        t = self.tensors
        self.vocab, self.hidden = t["table"].shape
        self.inter = t["w_down"].shape[0]
        self.hq, self.hkv, self.d, self.dv, self.r = num_heads, num_kv_heads, head_dim, v_head_dim, rotary_dim
        self.window, self.eps = window, eps
        h, n = self.hidden, (num_heads + num_kv_heads) * head_dim + num_kv_heads * v_head_dim
        want = {"table": (self.vocab, h), "w_h": (h, h), "norm_in": (h,), "w_qkv": (h, n),
                "w_o": (num_heads * v_head_dim, h), "norm_mlp": (h,), "w_gu": (h, 2 * self.inter),
                "w_down": (self.inter, h), "norm_final": (h,), "lm_head": (h, self.vocab), "sinks": (num_heads,)}
        self.fits = (num_kv_heads > 0 and num_heads % num_kv_heads == 0 and 0 <= rotary_dim <= head_dim
                     and rotary_dim % 2 == 0 and window >= 1
                     and all(_fits(t[k], shape, optional=k == "sinks") for k, shape in want.items()))
        self._weights = _Weights(*[None if t[k] is None else t[k].data_ptr() for k in _WEIGHT_NAMES])
        self._buffers: tuple = ()  # the last buffers that passed _buffers_fit

    def _buffers_fit(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
        batch, rows = (k_buf.shape[0], k_buf.shape[2]) if k_buf.dim() == 4 else (0, 0)
        slots = k_cache.shape[0] if k_cache.dim() else -1
        return (_f32_cpu_contiguous(k_cache, v_cache, cos, signed_sin, k_buf, v_buf) and cos.dim() == 2
                and signed_sin.shape == cos.shape and cos.shape[1] >= self.r
                and k_buf.shape == (batch, self.hkv, rows, self.d) and v_buf.shape == (batch, self.hkv, rows, self.dv)
                and v_cache.shape[:1] == (slots,) and k_cache.numel() == slots * self.hkv * self.d
                and v_cache.numel() == slots * self.hkv * self.dv)

    def draft(self, tokens: list[int], positions: list[int], h_prev: torch.Tensor, swa_pages: list[list[int]],
              page_size: int, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, k: int) -> list[list[int]] | None:
        """k draft tokens per request (FusedDraft.draft's contract), or None when the C kernel cannot
        serve. cos / signed_sin [P, L]: rows of the layer's rotary tables for positions 0 .. P - 1 (the
        first ``rotary_dim`` columns used); k_buf / v_buf [B, Hkv, rows, D or Dv]: the window buffers
        (scratch, rows >= W - 1 + k)."""
        batch, w = len(tokens), self.window
        if not self.fits or batch == 0 or not (batch == len(positions) == len(swa_pages)) or k < 1:
            return None
        if h_prev.shape != (batch, self.hidden) and not (batch == 1 and h_prev.shape == (self.hidden,)):
            return None
        buffers = (k_cache, v_cache, cos, signed_sin, k_buf, v_buf)
        if len(self._buffers) != len(buffers) or any(a is not b for a, b in zip(self._buffers, buffers)):
            if not self._buffers_fit(*buffers):  # checked once per buffer set (the same objects every draft)
                return None
            self._buffers = buffers
        if k_buf.shape[0] != batch or k_buf.shape[2] < w - 1 + k or not _f32_cpu_contiguous(h_prev):
            return None
        lib = _lib()
        if lib is None:
            return None
        rows = k_buf.shape[2]
        cached = [min(c, w - 1) for c in positions]
        flat, offsets, firsts, counts = [], [], [], []
        for c, n, pages in zip(positions, cached, swa_pages):  # the pages under positions c - n .. c - 1
            first_page = (c - n) // page_size
            window_pages = pages[first_page:(c - 1) // page_size + 1] if n else []
            offsets.append(len(flat))
            firsts.append(first_page)
            counts.append(len(window_pages))
            flat.extend(window_pages)
        shape = _Shape(batch, k, self.hidden, self.hq, self.hkv, self.d, self.dv, self.inter, self.vocab, w, self.r,
                       rows, self.eps)
        out = (_i64 * (k * batch))()
        rc = lib.mtp_draft_f32(ctypes.byref(shape), ctypes.byref(self._weights), h_prev.data_ptr(), _longs(tokens),
                               _longs(positions), cos.data_ptr(), signed_sin.data_ptr(), cos.shape[1], cos.shape[0],
                               _longs(cached), _longs(flat), _longs(offsets), _longs(firsts), _longs(counts),
                               page_size, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], k_buf.data_ptr(),
                               v_buf.data_ptr(), out)
        if rc == -3:
            raise RuntimeError("MTP draft reads a window position whose SWA page was released")
        if rc == -1:
            raise ValueError(f"MTP draft: a token, position or KV slot out of range (vocab {self.vocab}, "
                             f"{cos.shape[0]} rotary positions, {k_cache.shape[0]} slots)")
        if rc:
            raise MemoryError(f"MTP draft: no memory for the scratch of {batch} rows")
        return [[out[s * batch + b] for s in range(k)] for b in range(batch)]


def _fits(t: torch.Tensor | None, shape: tuple[int, ...], *, optional: bool) -> bool:
    if t is None:
        return optional
    return tuple(t.shape) == shape and t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def _f32_cpu_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
