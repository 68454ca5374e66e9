"""Torch reference for varlen *bidirectional* attention, optionally limited to a symmetric band.

Layout (packed, no batch axis):

    q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv]        Hq = G * Hkv (GQA: q head h reads kv head h // G)
    cu_seqlens [S+1]: segment s = rows [cu[s], cu[s+1])   attention never crosses a segment

Band semantics (symmetric, counted in tokens, *not* including the query in the count):

    query i sees key j  iff  same segment and |i - j| <= window      (2*window + 1 keys at most)

    ... i-w-1 [i-w ........ i ........ i+w] i+w+1 ...
               \\_______ 2w+1 keys ______/

``window=None`` means the whole segment. ``sinks[h]`` is a per-q-head logit that joins the softmax
denominator and carries no value (sink formula of docs/model.md §6).

Efficiency: the work is cut into *blocks* of queries, each with a contiguous span of keys, gathered
with index tensors and run as one batched matmul per chunk of blocks -- never an N x N mask:

    long segment, band:   queries [q0, q0+B)   keys [q0-w, q0+B+w)       span = B + 2w
    short segment / full: queries [q0, q0+B)   keys [0, Lpad)            span = Lpad (padded length)

Short segments are bucketed by padded length so many small images run as one batch. A plan (index
tensors and masks per chunk of blocks) depends only on (cu_seqlens, window, shapes) and is cached, so
the blocks of one encoder forward share it. Without sinks a chunk runs through torch's fused
``scaled_dot_product_attention``; with sinks the logits are explicit and the sink is applied after
the value product: with lse = logsumexp of the ordinary logits,

    softmax-with-sink = softmax * exp(lse) / (exp(lse) + exp(s)) = softmax * sigmoid(lse - s)

so it costs one scale of the [B, Dv] output instead of an extra key column.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Upper bound on the elements of one chunk's temporaries (fp32 logits, or gathered q/k/v).
_CHUNK_BUDGET = 1 << 24
# Upper bound on one block's query x key span (a 32k-token frame with full attention runs in query
# chunks rather than one 32k x 32k mask).
_SPAN_BUDGET = 1 << 24
# Query block of the banded path.
_BAND_BLOCK = 64
# Plans are kept by count *and* by bytes: with sinks on CPU a plan holds an fp32 bias per query block
# (x G q heads), ~50 MiB for one 16k-patch image at MiMo-V2.5's heads, so sixteen big images would pin
# ~0.8 GB long after their requests. A plan over the byte budget is used once and not kept -- building
# it is cheap next to the forward that needs it.
_PLAN_CACHE_SIZE = 16
_PLAN_CACHE_BYTES = 64 << 20
_plan_cache: "OrderedDict[tuple, tuple[list[_Chunk], int]]" = OrderedDict()
_plan_cache_bytes = 0
_plan_lock = threading.Lock()  # encoders may run on a worker thread beside other callers
# Sinks on CPU run through torch's fused flash kernel (see _attend_with_sinks_flash); False keeps the
# explicit-logits path (benchmarks and the equivalence test compare the two).
FUSED_SINKS = True


@dataclass(frozen=True)
class _Chunk:
    """``n`` blocks of ``block`` queries x ``span`` keys, as flat row indices into the packed axis."""

    n: int
    block: int
    span: int
    q_rows: torch.Tensor  # [n * block] int64 (padding rows clamped to a valid row)
    k_rows: torch.Tensor  # [n * span] int64 (clamped)
    mask: torch.Tensor | None  # [n, 1, block, span] bool, True = visible; None = all visible
    keep: torch.Tensor | None  # [m] positions of real queries in the flat [n * block] axis; None = all
    out_rows: torch.Tensor  # [m] packed rows those queries write
    # When q_rows / k_rows are one ascending run (unpadded full attention over adjacent equal
    # segments, e.g. the frames of a video) the gather becomes a free slice: first row, else None.
    q_run: int | None
    k_run: int | None
    # Sinks on CPU: ``mask`` as an additive fp32 bias, repeated for the G q heads that share a kv
    # head ([n, 1, G * block, span], 0 / -inf), so one fused flash call serves a whole kv head.
    sink_bias: torch.Tensor | None = None


def _validate(q, k, v, cu_seqlens, window, sinks) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"band_attention expects q/k/v of rank 3, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q/k/v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"head layout mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [num_segments + 1]")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape [{q.shape[1]}], got {tuple(sinks.shape)}")


def _bucket_length(length: int) -> int:
    """Padded key span of a dense segment. Long segments keep their exact length (few of them, and
    an unpadded bucket needs no mask); short ones round up to one of four lengths per octave
    (<= 25% padding) so many small images share one batched call."""
    if length >= 256:
        return length
    if length <= 16:
        return 16
    step = 1 << max(0, length.bit_length() - 3)
    return -(-length // step) * step


def _make_chunks(starts, lens, q0, key0, block: int, span: int, window, per_block: int, device,
                 sink_group: int = 0) -> list[_Chunk]:
    """Blocks b: queries start[b] + q0[b] + [0, block), keys start[b] + key0[b] + [0, span).
    ``sink_group`` > 0 (sinks, CPU) also builds the chunk's folded additive bias."""
    chunks = []
    step = max(1, _CHUNK_BUDGET // per_block)
    for c0 in range(0, len(starts), step):
        sl = slice(c0, c0 + step)
        st = torch.tensor(starts[sl], dtype=torch.int64, device=device)[:, None]
        ln = torch.tensor(lens[sl], dtype=torch.int64, device=device)[:, None]
        q_local = torch.tensor(q0[sl], dtype=torch.int64, device=device)[:, None] + torch.arange(block, device=device)
        k_local = torch.tensor(key0[sl], dtype=torch.int64, device=device)[:, None] + torch.arange(span, device=device)
        q_valid = q_local < ln
        k_valid = (k_local >= 0) & (k_local < ln)
        mask = None
        if window is not None or not bool(k_valid.all()):
            mask = k_valid[:, None, :].expand(-1, block, -1)
            if window is not None:
                mask = mask & ((q_local[:, :, None] - k_local[:, None, :]).abs() <= window)
            mask = mask[:, None].contiguous()
        q_rows = (st + torch.where(q_valid, q_local, 0)).reshape(-1)
        keep = None if bool(q_valid.all()) else q_valid.reshape(-1).nonzero().squeeze(1)
        k_rows = (st + torch.where(k_valid, k_local, 0)).reshape(-1)
        sink_bias = None
        if sink_group and mask is not None:
            sink_bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
            sink_bias = sink_bias.repeat(1, 1, sink_group, 1)
        chunks.append(_Chunk(
            n=int(st.shape[0]), block=block, span=span, q_rows=q_rows, k_rows=k_rows, mask=mask, keep=keep,
            out_rows=q_rows if keep is None else q_rows[keep],
            q_run=_run_start(q_rows) if keep is None else None, k_run=_run_start(k_rows), sink_bias=sink_bias,
        ))
    return chunks


def _run_start(rows: torch.Tensor) -> int | None:
    """First row if ``rows`` is one ascending run of consecutive rows, else None."""
    first = int(rows[0])
    steps_ok = rows.numel() == 1 or bool((rows[1:] - rows[:-1] == 1).all())
    return first if steps_ok else None


def _plan(seg_lens: list[int], window: int | None, heads: tuple[int, int, int, int], sinks: bool,
          device) -> list[_Chunk]:
    """Cut every segment into query blocks, group blocks of equal geometry, cut groups into chunks."""
    num_heads, num_kv, d, dv = heads

    def per_block(block: int, span: int) -> int:
        if sinks:  # the fp32 logits dominate
            return 2 * num_heads * block * span
        return block * num_heads * d + span * num_kv * (d + dv) + block * span

    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    banded_limit = None if window is None else _BAND_BLOCK + 2 * window
    dense: dict[int, list[int]] = {}
    band: tuple[list, list, list, list] = ([], [], [], [])
    for s, n in enumerate(seg_lens):
        if n == 0:
            continue
        if banded_limit is not None and n > banded_limit:
            for q0 in range(0, n, _BAND_BLOCK):
                for lst, val in zip(band, (starts[s], n, q0, q0 - window)):
                    lst.append(val)
        else:
            dense.setdefault(_bucket_length(n), []).append(s)
    # torch's flash kernel needs one head size for q, k and v
    fold = num_heads // num_kv if sinks and d == dv and _flash_sinks_ok(device) else 0
    chunks = []
    if band[0]:
        span = _BAND_BLOCK + 2 * window
        chunks += _make_chunks(*band, _BAND_BLOCK, span, window, per_block(_BAND_BLOCK, span), device, fold)
    for padded, segs in sorted(dense.items()):
        lengths = {seg_lens[s] for s in segs}
        if len(lengths) == 1:
            # One length in the bucket (a video's frames, a lone image): no padding is needed to batch
            # them, so no mask and -- for adjacent segments -- slices instead of gathers.
            padded = lengths.pop()
        block = max(16, min(padded, _SPAN_BUDGET // padded))
        s_list, n_list, q_list = [], [], []
        for s in segs:
            for q0 in range(0, seg_lens[s], block):
                s_list.append(starts[s])
                n_list.append(seg_lens[s])
                q_list.append(q0)
        chunks += _make_chunks(s_list, n_list, q_list, [0] * len(s_list), block, padded, window,
                               per_block(block, padded), device, fold)
    return chunks


def _plan_bytes(plan: list[_Chunk]) -> int:
    tensors = [t for c in plan for t in (c.q_rows, c.k_rows, c.out_rows, c.mask, c.keep, c.sink_bias)
               if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def _cached_plan(cu: list[int], window, heads, sinks: bool, device) -> list[_Chunk]:
    global _plan_cache_bytes
    key = (tuple(cu), window, heads, sinks, str(device))
    with _plan_lock:
        entry = _plan_cache.get(key)
        if entry is not None:
            _plan_cache.move_to_end(key)
            return entry[0]
    plan = _plan([b - a for a, b in zip(cu, cu[1:])], window, heads, sinks, device)
    size = _plan_bytes(plan)
    if size > _PLAN_CACHE_BYTES:
        return plan
    with _plan_lock:
        if key not in _plan_cache:  # another thread may have planned the same geometry meanwhile
            _plan_cache[key] = (plan, size)
            _plan_cache_bytes += size
        while len(_plan_cache) > _PLAN_CACHE_SIZE or _plan_cache_bytes > _PLAN_CACHE_BYTES:
            _plan_cache_bytes -= _plan_cache.popitem(last=False)[1][1]
    return plan


def _flash_sinks_ok(device) -> bool:
    """torch's fused CPU flash kernel returns the logsumexp the sink gate needs."""
    return FUSED_SINKS and torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _attend_with_sinks_flash(qb, kb, vb, c: _Chunk, scale, sinks):
    """Same result as :func:`_attend_with_sinks` in one fused kernel (no fp32 logits tensor, no
    separate exp / normalise passes): the G q heads of a kv head are folded onto the query axis
    ([n, Hkv, G * B, D]) so K/V are read once, and the gate uses the kernel's logsumexp."""
    n, num_heads, block, d = qb.shape
    num_kv = kb.shape[1]
    group = num_heads // num_kv
    bias = c.sink_bias
    if bias is not None and bias.dtype != qb.dtype:
        bias = bias.to(qb.dtype)
    ob, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb.reshape(n, num_kv, group * block, d), kb, vb, 0.0, False, attn_mask=bias, scale=scale)
    gate = torch.sigmoid(lse.reshape(n, num_kv, group, block) - sinks.float().view(1, num_kv, group, 1))
    return ob.reshape(n, num_heads, block, -1) * gate.reshape(n, num_heads, block, 1).to(ob.dtype)


def _attend_with_sinks(qb, kb, vb, mask, scale, sinks):
    """qb [n, Hq, B, D] -> [n, Hq, B, Dv] with explicit fp32 logits; the G q heads of a kv head
    share one matmul (no K/V repeat)."""
    n, num_heads, block, d = qb.shape
    num_kv, span = kb.shape[1], kb.shape[2]
    group = num_heads // num_kv
    logits = torch.matmul(qb.reshape(n, num_kv, group * block, d), kb.transpose(-1, -2)).float()
    logits = logits.view(n, num_kv, group, block, span).mul_(scale)
    if mask is not None:
        logits.masked_fill_(~mask[:, None], float("-inf"))
    # In-place softmax that keeps its normaliser: lse = max + log(sum exp(logit - max)). Padded query
    # rows (all keys masked) turn NaN here and are dropped by the caller.
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    denom = probs.sum(dim=-1, keepdim=True)
    probs.div_(denom)
    ob = torch.matmul(probs.view(n, num_kv, group * block, span).to(vb.dtype), vb).view(n, num_kv, group, block, -1)
    gate = torch.sigmoid((row_max + denom.log()).squeeze(-1) - sinks.float().view(1, num_kv, group, 1))
    return (ob * gate.unsqueeze(-1).to(ob.dtype)).view(n, num_heads, block, -1)


def _run_chunk(q, k, v, c: _Chunk, out, scale, sinks) -> None:
    num_heads, num_kv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    # index_select copies whole rows (memcpy); advanced indexing would gather element by element.
    q_rows = q.narrow(0, c.q_run, c.n * c.block) if c.q_run is not None else q.index_select(0, c.q_rows)
    if c.k_run is not None:
        k_rows, v_rows = k.narrow(0, c.k_run, c.n * c.span), v.narrow(0, c.k_run, c.n * c.span)
    else:
        k_rows, v_rows = k.index_select(0, c.k_rows), v.index_select(0, c.k_rows)
    qb = q_rows.reshape(c.n, c.block, num_heads, d).transpose(1, 2)
    kb = k_rows.reshape(c.n, c.span, num_kv, d).transpose(1, 2)
    vb = v_rows.reshape(c.n, c.span, num_kv, dv).transpose(1, 2)
    if sinks is None:
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=c.mask, scale=scale, enable_gqa=True)
    elif dv == d and (c.sink_bias is not None or c.mask is None) and _flash_sinks_ok(q.device):
        ob = _attend_with_sinks_flash(qb, kb, vb, c, scale, sinks)
    else:
        ob = _attend_with_sinks(qb, kb, vb, c.mask, scale, sinks)
    ob = ob.transpose(1, 2).reshape(c.n * c.block, num_heads, dv)
    if c.q_run is not None:
        out.narrow(0, c.q_run, c.n * c.block).copy_(ob)
        return
    if c.keep is not None:
        ob = ob.index_select(0, c.keep)
    out.index_copy_(0, c.out_rows, ob.to(out.dtype))


def band_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional varlen attention (see module doc) -> [N, Hq, Dv]."""
    _validate(q, k, v, cu_seqlens, window, sinks)
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {q.shape[0]}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    heads = (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for chunk in _cached_plan(cu, window, heads, sinks is not None, q.device):
        _run_chunk(q, k, v, chunk, out, scale, sinks)
    return out
