"""Python side of ``paged_decode.c``: decode rows of one step attend over their keys in the pool in place.

:class:`DecodeRows` is what the C kernel needs of a step (block table, lengths, which request each
decode row is, window), checked once when the step's attention plan is built and shared by every layer
of that pool. :func:`decode_attention` checks the per-layer tensors (dtype, device, layout: reading
through a raw pointer trusts them) and returns None when the kernel cannot take the call, so the
caller keeps its torch path: a non-fp32 dtype, CUDA, strides it does not handle, or the kernels off
(``kernels.native.library`` returns None).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.host_index import long_tensor
from kernels.native.build import library, openmp_flags

_P = ctypes.c_void_p
_L = ctypes.c_long
_ARGTYPES = [_P, _L, _P, _P, _L, _P, _L, _P, _P, _P, _L, _P, _P, _L, _L, _L, _L, _L, _L, _L, ctypes.c_float, _L, _P]
_SIGNATURES = {"paged_decode_attention": (_ARGTYPES, ctypes.c_long)}


FLAGS = ("-fopenmp-simd", "-ffp-contract=fast")  # omp simd loops; a * b + c as one FMA


def _lib(flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The built kernel (``flags``: the build's, default FLAGS and OpenMP where torch's runtime is
    loaded: a long call on a wide thread splits its rows; tests add -DPAGED_DECODE_VL8), None when off."""
    return library("paged_decode", flags=FLAGS + openmp_flags() if flags is None else flags, signatures=_SIGNATURES)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can serve a step of this dtype and device (it is built and switched on)."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and _lib() is not None


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step over one pool: row i is query row ``rows[i]`` of request
    ``requests[i]`` (its block-table row and ``seq_lens`` entry). Built by :meth:`build`, which checks
    every index the kernel follows except the page ids (the kernel checks those as it reads)."""

    table: torch.Tensor  # [R, P] int64, contiguous: physical page of each logical page, -1 released
    seq_lens: torch.Tensor  # [R] int64: context of each request including this step's token
    requests: torch.Tensor  # [D] int64
    rows: torch.Tensor  # [D] int64
    num_tokens: int  # query rows of the step (rows index into them)
    page_size: int
    window: int | None
    # a run of one request's rows longer than this goes through the kernel's chunk path (paged_decode.c
    # attend_chunk: not single-row bits, each row's own whatever the split); 0: none does
    chunk_after: int = 0

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """data_ptr() of table, seq_lens, requests, rows (what the C call takes; read once per step,
        not per layer)."""
        return (self.table.data_ptr(), self.seq_lens.data_ptr(), self.requests.data_ptr(), self.rows.data_ptr())

    @staticmethod
    def build(table: torch.Tensor, seq_lens: torch.Tensor, requests: Sequence[int], rows: Sequence[int], *,
              num_tokens: int, page_size: int, window: int | None, chunk_after: int = 0) -> DecodeRows:
        if table.dim() != 2 or seq_lens.dim() != 1:
            raise ValueError(f"block table {tuple(table.shape)} / seq_lens {tuple(seq_lens.shape)}: expected 2-D / 1-D")
        if len(requests) != len(rows):
            raise ValueError(f"{len(requests)} decode requests but {len(rows)} query rows")
        limit = min(table.shape[0], seq_lens.shape[0])
        if requests and not (0 <= min(requests) and max(requests) < limit):
            raise ValueError(f"decode request index outside the block table's {limit} rows")
        if rows and not (0 <= min(rows) and max(rows) < num_tokens):
            raise ValueError(f"decode query row outside the step's {num_tokens} rows")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if chunk_after < 0:
            raise ValueError(f"chunk_after must be >= 0, got {chunk_after}")
        return DecodeRows(table.to(device="cpu", dtype=torch.long).contiguous(),
                          seq_lens.to(device="cpu", dtype=torch.long).contiguous(),
                          long_tensor(requests), long_tensor(rows),
                          num_tokens, page_size, window, chunk_after)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeRows, *,
                     scale: float, sinks: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of the decode rows ``decode.rows`` of q [T, Hq, dqk] over the pool, written into
    those rows of ``out`` [T, Hq, dv] (new when None; other rows untouched) and returned; None when
    the kernel cannot take the call. Raises RuntimeError when a visible key's page was released and
    ValueError when a page id lies outside the pool or a context outside the block table."""
    lib = _lib()
    if lib is None or not _fits(q, k_cache, v_cache, sinks, decode):
        return None
    t, hq, dqk = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if out is None:
        out = q.new_empty(t, hq, dv)
    elif out.shape != (t, hq, dv) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected contiguous float32 {(t, hq, dv)}")
    if sinks is not None:
        sinks = sinks.detach().contiguous()
    error = (ctypes.c_long * 2)()
    table, lens, requests, rows = decode.pointers
    status = lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], table,
        decode.table.shape[1], lens, requests, rows, decode.rows.shape[0], None if sinks is None else sinks.data_ptr(),
        out.data_ptr(), hq * dv, hq, hkv, dqk, dv, decode.page_size, decode.window or 0, scale, decode.chunk_after, error)
    if status:
        _raise(status, decode, int(error[0]), int(error[1]), k_cache.shape[0])
    return out


def _fits(q, k_cache, v_cache, sinks, decode: DecodeRows) -> bool:
    """The layouts the kernel reads: fp32 CPU tensors, q rows of contiguous heads (the projection's
    view may have a longer row stride), a contiguous pool, q/k dims equal, whole GQA groups. (Runs
    once per layer call: plain attribute checks, no tensor ops.)"""
    f32 = torch.float32
    if q.dtype is not f32 or k_cache.dtype is not f32 or v_cache.dtype is not f32:
        return False
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu) or q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        return False
    t, hq, dqk = q.shape
    slots, hkv, dk = k_cache.shape
    if t != decode.num_tokens or dk != dqk or v_cache.shape[0] != slots or v_cache.shape[1] != hkv:
        return False
    if hkv == 0 or hq % hkv or slots % decode.page_size:
        return False
    if sinks is not None and (sinks.dtype is not f32 or not sinks.is_cpu or sinks.numel() != hq):
        return False
    qs = q.stride()
    return qs[2] == 1 and qs[1] == dqk and qs[0] >= hq * dqk and k_cache.is_contiguous() and v_cache.is_contiguous()


def _raise(status: int, decode: DecodeRows, row: int, pos: int, num_slots: int) -> None:
    if status < 0:
        raise MemoryError("paged decode attention: scratch memory could not be allocated")
    request = int(decode.requests[row])
    if status == 2:
        raise ValueError(f"decode request {request} has context {pos + 1}, longer than its block table row "
                         f"({decode.table.shape[1]} pages of {decode.page_size})")
    page = int(decode.table[request, pos // decode.page_size])
    if page < 0:
        raise RuntimeError(f"attention reads logical position {pos} whose page was released")
    raise ValueError(f"attention reads logical position {pos} from page {page}, outside the pool of "
                     f"{num_slots // decode.page_size} pages")
