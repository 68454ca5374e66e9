"""Triton paged attention over one KV pool: decode and extend (chunked prefill) in one kernel.

Same contract as :func:`kernels.attention_ref.paged_attention_ref` (pool layout, window semantics,
sinks, GQA, q/k dim != v dim). One program owns a *query block* of one request and one KV head:

    rows of the program tile (BLOCK_M = BLOCK_Q * BLOCK_G):

        row r  ->  token  q0 + r // BLOCK_G      (BLOCK_Q consecutive new tokens of request b)
               ->  head   kvh * GROUP + r % BLOCK_G   (the GQA group sharing KV head kvh)

so a decode step (one token per request) still fills the tile with the group's heads and every
key tile loaded from the cache is reused by all heads that share it.

Program ids map to (request, query block) without host work: request b owns the program ids

    [qsl[b] // BLOCK_Q + b,  qsl[b+1] // BLOCK_Q + b + 1)      (>= ceil(n_b / BLOCK_Q) ids)

and a program finds its request by binary search over qsl; surplus ids return at once. The grid
is therefore ``T // BLOCK_Q + B`` programs per KV head.

Key positions are read through the page table one key at a time (``page = table[b, j // P]``), so
keys need not align to pages and a page straddling the window edge is read only from its visible
part; released pages (-1) lie wholly behind the window and are never touched. (A -1 page *inside*
the visible range is an engine bug the reference raises on; here its keys are masked, never read.)

Split-KV (decode on CUDA with few programs, or ``num_splits``): a third grid axis cuts each
program's key range into BLOCK_N-aligned chunks; every split writes unnormalised (acc, m, l) and
``combine_splits_kernel`` merges them. Only split 0 starts from the sink, so it is counted once:

    keys  [k_lo ............................................ k_hi)
          |-- split 0 (+sink) --|-- split 1 --|-- split 2 --|
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def softmax_tile_update(s, visible, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step (base-2 logits) -> (m, l, acc).

    Rows with no visible key so far keep m = -inf; the exponent base is clamped to 0 for them so
    exp2(-inf - -inf) never produces NaN.
    """
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_base[:, None])
    alpha = tl.exp2(m_i - m_base)
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_new, acc


@triton.jit
def find_owner(starts_ptr, count, pid, BLOCK_Q: tl.constexpr):
    """Largest b in [0, count) with starts[b] // BLOCK_Q + b <= pid (see the module docstring)."""
    lo = 0
    hi = count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_id = tl.load(starts_ptr + mid) // BLOCK_Q + mid
        if first_id <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["stride_bt", "num_requests", "num_tokens"])
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, sinks_ptr, part_acc_ptr, part_ml_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_bt, num_requests, num_tokens, window, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = find_owner(qsl_ptr, num_requests, pid, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + b)
    q_end = tl.load(qsl_ptr + b + 1)
    q0 = q_begin + (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if q0 >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    # positions of this request's new tokens: seq_len - n_b .. seq_len - 1
    pos_offset = seq_len - (q_end - q_begin) - q_begin

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // BLOCK_G
    grp = rows % BLOCK_G
    head = kvh * GROUP + grp
    row_ok = (tok < q_end) & (grp < GROUP)
    q_pos = tok + pos_offset
    tok64 = tok.to(tl.int64)

    d0 = tl.arange(0, BLOCK_D0)
    q_rows = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh
    q_a = tl.load(q_rows + d0[None, :], mask=row_ok[:, None] & (d0[None, :] < HEAD_DIM), other=0.0)
    if BLOCK_D1 > 0:
        d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
        q_b = tl.load(q_rows + d1[None, :], mask=row_ok[:, None] & (d1[None, :] < HEAD_DIM), other=0.0)
    dv = tl.arange(0, BLOCK_DV)

    if HAS_SINKS:
        # The sink joins the softmax as a key with logit s_h and no value: start the running max at
        # it with mass exp(0) = 1, which also keeps m finite for every row. With split keys only
        # split 0 carries it, so the combine counts it once.
        sink = tl.load(sinks_ptr + head, mask=grp < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    last_tok = tl.minimum(q0 + BLOCK_Q, q_end) - 1
    k_hi = last_tok + pos_offset + 1
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(q0 + pos_offset - window + 1, 0)
    if NUM_SPLITS > 1:
        # split-KV (flash-decoding): split s takes the s-th BLOCK_N-aligned chunk of [k_lo, k_hi)
        chunk = tl.cdiv(tl.cdiv(k_hi - k_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_lo = k_lo + split * chunk
        k_hi = tl.minimum(k_hi, k_lo + chunk)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for start in range(k_lo, k_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + k_pos // PAGE_SIZE, mask=k_pos < k_hi, other=-1).to(tl.int64)
        k_ok = (k_pos < k_hi) & (page >= 0)
        slot = page * PAGE_SIZE + k_pos % PAGE_SIZE
        k_cols = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh
        k_a = tl.load(k_cols + d0[:, None], mask=k_ok[None, :] & (d0[:, None] < HEAD_DIM), other=0.0)
        s = tl.dot(q_a, k_a, input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            k_b = tl.load(k_cols + d1[:, None], mask=k_ok[None, :] & (d1[:, None] < HEAD_DIM), other=0.0)
            s += tl.dot(q_b, k_b, input_precision=DOT_PRECISION)
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
            mask=k_ok[:, None] & (dv[None, :] < V_DIM), other=0.0,
        )
        m_i, l_i, acc = softmax_tile_update(s * scale_log2, visible, v, m_i, l_i, acc, DOT_PRECISION)

    if NUM_SPLITS > 1:
        # unnormalised partials [split, token, head] for combine_splits_kernel
        part = (split * num_tokens + tok64) * (tl.num_programs(1) * GROUP) + head
        tl.store(part_acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM))


@triton.jit(do_not_specialize=["num_tokens"])
def combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_tokens,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (t, h): merge the split partials of one query head -> out[t, h] (base-2 logits)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    live = s < NUM_SPLITS
    part = (s * num_tokens + t) * tl.num_programs(1) + h
    m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], mask=live[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < V_DIM)


def dim_blocks(dim: int) -> tuple[int, int]:
    """Split a head dim into two power-of-two dot chunks (each >= 16, the MMA minimum).

    192 -> (128, 64): no wasted lanes, unlike padding to 256. 24 -> (16, 16), tail masked.
    """
    first = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - first
    return first, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (tf32 would break parity with the reference)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         sinks: torch.Tensor | None, k_name: str = "k_cache", v_name: str = "v_cache") -> None:
    """Shared validation of q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] and sinks [Hq]."""
    for name, t in (("q", q), (k_name, k_cache), (v_name, v_cache)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens|slots, heads, dim], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.dtype != q.dtype or not t.dtype.is_floating_point:
            raise ValueError(f"{name} dtype {t.dtype} must be a float dtype equal to q's {q.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"{k_name} {tuple(k_cache.shape)} and {v_name} {tuple(v_cache.shape)} disagree on rows/heads")
    if q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != {k_name} head dim {k_cache.shape[2]}")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not split into {k_cache.shape[1]} KV heads")
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks must be [{q.shape[1]}] (one per query head), got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int = 64,
    num_splits: int | None = None,
    decode_keys: int | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention of new tokens over a paged cache -> [T, Hq, Dv].

    Drop-in for :func:`kernels.attention_ref.paged_attention_ref`. ``block_n`` (keys per tile, a
    power of two >= 16) and ``num_splits`` (key-range splits merged by a second kernel; default:
    chosen for decode on CUDA so small batches with long contexts still fill the GPU) exist so tests
    can reach several tiles and splits on tiny contexts.

    ``decode_keys``: the step is a decode step (one new token per request) whose lengths live on the
    device -- a CUDA-graph decode step -- and no request has more than this many tokens. Reading
    ``query_start_loc`` / ``seq_lens`` on the host would sync (and cannot be captured), so this bound
    picks the decode tile and the key splits instead, and the host checks of the lengths are skipped.
    The splits are then fixed for every replay of the graph; each request still cuts its own key
    range into that many chunks in the kernel, so shorter contexts stay exact (some splits are empty).
    """
    check_attention_args(q, k_cache, v_cache, sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_kv, v_dim = k_cache.shape[1], v_cache.shape[2]
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is not None and not 1 <= num_splits <= 64:
        raise ValueError(f"num_splits must be in [1, 64], got {num_splits}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be 2-D int32/int64, got {tuple(block_table.shape)} {block_table.dtype}")
    num_requests = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_requests + 1,):
        raise ValueError(
            f"query_start_loc must be [B+1] and seq_lens [B]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(seq_lens.shape)}"
        )
    if block_table.shape[0] < num_requests:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_requests} requests")
    out = q.new_empty(num_tokens, num_heads, v_dim)
    if num_requests == 0 or num_tokens == 0:
        return out

    if decode_keys is not None and decode_keys < 1:
        raise ValueError(f"decode_keys must be positive or None, got {decode_keys}")
    max_new = num_tokens
    if decode_keys is not None:
        max_new = 1  # the caller's word: one new token per request (the tile choice only; any batch is exact)
    elif not query_start_loc.is_cuda:  # cheap host checks; on device they would force a sync
        qsl = query_start_loc.tolist()
        if qsl[0] != 0 or qsl[-1] > num_tokens or any(a > c for a, c in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must rise from 0 to at most {num_tokens}, got {qsl}")
        max_new = max(c - a for a, c in zip(qsl, qsl[1:]))
        if bool((seq_lens.cpu() < torch.diff(query_start_loc.cpu())).any()):
            raise ValueError("a request has more new tokens than its seq_len")

    group = num_heads // num_kv
    block_g = triton.next_power_of_2(group)
    # Decode fills the tile with GQA heads only; extend stacks query tokens on top (~64 rows).
    block_q = max(1, (16 if max_new == 1 else 64) // block_g)
    block_d0, block_d1 = dim_blocks(head_dim)
    dev = q.device
    # non-blocking: a plain copy from the host would synchronize the stream (twice a layer on every
    # eager step); the lengths are fresh host tensors, which CUDA stages before the call returns
    qsl_dev = query_start_loc.to(device=dev, dtype=torch.int64, non_blocking=True)
    lens_dev = seq_lens.to(device=dev, dtype=torch.int64, non_blocking=True)
    table = block_table.to(dev).contiguous()
    block_dv = max(16, triton.next_power_of_2(v_dim))
    if num_splits is None:
        num_splits = auto_splits(q, seq_lens, window, num_requests * num_kv, decode_keys) if max_new == 1 else 1
    part_acc = part_ml = out  # dummy pointers unless split
    if num_splits > 1:
        part_acc = torch.empty(num_splits, num_tokens, num_heads, block_dv, dtype=torch.float32, device=dev)
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=dev)
    sinks_arg = sinks if sinks is not None else q  # dummy pointer, never read without HAS_SINKS
    grid = (num_tokens // block_q + num_requests, num_kv, num_splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, out, table, qsl_dev, lens_dev, sinks_arg, part_acc, part_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), table.stride(0), num_requests, num_tokens, window or 0, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D0=block_d0, BLOCK_D1=block_d1, BLOCK_DV=block_dv,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(q.dtype),
        NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), num_tokens,
            V_DIM=v_dim, BLOCK_DV=block_dv, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_splits(q: torch.Tensor, seq_lens: torch.Tensor, window: int | None, programs: int,
                decode_keys: int | None = None) -> int:
    """Key splits for a decode step on CUDA (:func:`device_splits`); 1 elsewhere. The longest
    context comes from ``seq_lens`` on the host, else from ``decode_keys`` (lengths on the device:
    reading them would sync); with neither, 1."""
    if not q.is_cuda:
        return 1
    if not seq_lens.is_cuda:
        return device_splits(q.device, programs, int(seq_lens.max()), window)
    return 1 if decode_keys is None else device_splits(q.device, programs, decode_keys, window)


def device_splits(device: torch.device, programs: int, keys: int, window: int | None) -> int:
    """:func:`split_count` on CUDA ``device`` for ``programs`` (request, KV head) programs whose
    longest context is ``keys`` tokens, of which a sliding ``window`` reads the last ``window``."""
    return split_count(_sm_count(device.index or 0), programs, keys if window is None else min(keys, window))


def split_count(sm_count: int, programs: int, keys: int) -> int:
    """Splits of each program's key range: enough programs for ~2 waves of ``sm_count`` SMs, at least
    256 keys per split, at most 16 splits, rounded down to a power of two -- so a caller that captures
    CUDA graphs per split count needs at most five per batch shape."""
    want = min(triton.cdiv(2 * sm_count, max(1, programs)), triton.cdiv(max(1, keys), 256), 16)
    return 1 << (max(1, want).bit_length() - 1)
