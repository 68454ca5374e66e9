"""Dispatch: CUDA tensors take the Triton kernels (when importable); CPU tensors take the CPU paths
(paged attention: :mod:`kernels.cpu.paged_attention`; experts: :mod:`kernels.cpu.moe`, which hands
few-rows-per-expert calls to the C kernel :mod:`kernels.native.moe_experts`) and, for the
KV copies and the vision band attention, the torch references. ``force_triton(True)`` sends every call
to Triton (tests use it with TRITON_INTERPRET=1 to run the kernels on CPU tensors).

The Triton modules are imported lazily, on the first call that needs them: whether ``triton.jit``
builds a compiled or an interpreted kernel is decided when the module is imported, so importing them
here eagerly would freeze that choice for every process that merely imports ``kernels.ops``.

Routing (``route``) stays in torch on every device: it is a few small elementwise/top-k ops.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType

import torch

from kernels import kv_copy_ref, moe_ref
from kernels.block_fp8 import BlockFP8

_FORCE_TRITON = False
_TRITON_OK: bool | None = None  # None: not probed yet


def force_triton(enabled: bool) -> None:
    """Route every op through Triton even for CPU tensors (only meaningful with TRITON_INTERPRET=1)."""
    global _FORCE_TRITON
    _FORCE_TRITON = enabled


def use_triton(t: torch.Tensor) -> bool:
    return _FORCE_TRITON or t.is_cuda


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` torch's current CUDA device for the body when it is not already (else nothing).

    Triton launches its kernels on the current device, not on the tensors' (PyTorch's own ops follow
    their tensors), and so do CUDA-graph capture and replay. A thread's current device is cuda:0
    unless it set one: a model on cuda:1 (a single process's ``--device cuda:1``, an encoder on a GPU
    of its own called from the engine thread, a KV tier's loader thread) would otherwise run there
    with pointers into another GPU."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _kernels_for(t: torch.Tensor, name: str) -> ModuleType | None:
    """The Triton module serving tensor ``t`` (None: use the torch reference)."""
    if not use_triton(t):
        return None
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("force_triton(True) with CPU tensors needs TRITON_INTERPRET=1 in the environment "
                           "before the Triton kernels are first imported")
    return _triton_module(name)


def _triton_module(name: str) -> ModuleType | None:
    """``kernels.<name>``, or None when Triton itself cannot be imported (the reference then serves).

    Only a missing Triton falls back; an error inside a kernel module propagates.
    """
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401
            _TRITON_OK = True
        except ImportError:
            _TRITON_OK = False
    return importlib.import_module(f"kernels.{name}") if _TRITON_OK else None


def paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, page_size, scale,
                    window=None, sinks=None, plan=None, k_new=None, v_new=None, decode_keys=None):
    """Causal (optionally windowed, with sinks) attention of new tokens over a paged pool -> [T, Hq, Dv].

    Serves decode, extend and mixed batches; see :mod:`kernels.attention_ref` for the contract.
    ``plan``: what :func:`attention_plan` returned for this step, pool and window (None: built here);
    the CPU path then reads nothing else of the batch (``block_table``, ``query_start_loc`` and
    ``seq_lens`` may be None: a step's logits rows attend through a plan picked from the step's).
    ``k_new`` / ``v_new``: this step's keys and values, already stored into the pool; the CPU path
    reads a fresh prompt chunk's keys from them instead of gathering them back (the result is the same).
    ``decode_keys``: a decode step whose lengths live on the device (a CUDA graph) and the host-known
    bound of its contexts, from which the Triton kernel picks its key splits (:func:`decode_splits`).
    """
    mod = _kernels_for(q, "paged_attention_triton")
    if mod is not None:
        with on_device(q.device):
            return mod.paged_attention_triton(
                q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                page_size=page_size, scale=scale, window=window, sinks=sinks, decode_keys=decode_keys,
            )
    # Without Triton: decode rows as one padded batch, index work shared by the step's layers.
    from kernels.cpu.paged_attention import paged_attention_cpu

    return paged_attention_cpu(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
        page_size=page_size, scale=scale, window=window, sinks=sinks, plan=plan, k_new=k_new, v_new=v_new,
    )


def decode_splits(q, num_requests: int, num_kv_heads: int, window: int | None, keys: int) -> int:
    """The key splits :func:`paged_attention` gives a decode step of ``num_requests`` requests on
    ``q``'s device when called with ``decode_keys=keys`` (1 where the Triton kernel does not serve):
    what a CUDA-graph decode step is captured with, so its runner keys its graphs by it."""
    mod = _kernels_for(q, "paged_attention_triton")
    if mod is None or not q.is_cuda:
        return 1
    return mod.device_splits(q.device, num_requests * num_kv_heads, keys, window)


def attention_plan(q, block_table, query_start_loc, seq_lens, *, page_size, window=None, keys=None, head_dim=None):
    """The per-step index work of :func:`paged_attention` for one pool and window, to pass as ``plan``
    to every layer of that kind (None where the device's kernel needs none). ``keys``: a fixed
    decode key-grid width (default: the batch's widest visible span). ``head_dim``: the layers'
    query/key head size (where the C kernel's chunk path pays; None: unknown, not taken)."""
    if use_triton(q):
        return None
    from kernels.cpu.attention_plan import AttentionPlan

    return AttentionPlan.build(block_table, query_start_loc, seq_lens, page_size=page_size, window=window,
                               dtype=q.dtype, keys=keys, head_dim=head_dim)


def attention_decode_plans(q, block_table, seq_lens, active, rows, *, page_size, window=None):
    """:func:`attention_plan` of S consecutive all-decode steps over one page table, built at once:
    step s decodes the requests ``active[s]`` (their indices: ``rows[s]``; ``active`` None: all of
    them) with contexts ``seq_lens[s]`` ([S, B]); None per step where the device's kernel needs no plan."""
    if use_triton(q):
        return [None] * seq_lens.shape[0]
    from kernels.cpu.attention_plan import AttentionPlan

    return AttentionPlan.decode_steps(block_table, seq_lens, active, rows, page_size=page_size, window=window,
                                      dtype=q.dtype)


def store_kv(k_cache, v_cache, slot_mapping, k, v, *, all_valid=False) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v); slots < 0 are padding and skipped.
    ``all_valid``: the caller guarantees no slot < 0 (the CPU path then skips its check, a host sync
    a compiled step cannot hold)."""
    mod = _kernels_for(k_cache, "kv_copy_triton")
    if mod is not None:
        with on_device(k_cache.device):
            mod.store_kv_triton(k_cache, v_cache, slot_mapping, k, v)
    else:
        kv_copy_ref.store_kv_ref(k_cache, v_cache, slot_mapping, k, v, all_valid=all_valid)


def gather_slots(cache, slots, valid=None):
    """Rows ``cache[slots]`` as a new tensor; rows ``valid`` marks False come back zero (tier copies).

    Slots must lie in [0, num_slots): the Triton path treats any other slot as invalid (zero row).
    """
    mod = _kernels_for(cache, "kv_copy_triton")
    if mod is not None:
        with on_device(cache.device):
            return mod.gather_slots_triton(cache, slots, valid)
    return kv_copy_ref.gather_slots_ref(cache, slots, valid)


def scatter_slots(cache, slots, rows, valid=None) -> None:
    """``cache[slots] = rows`` for the rows ``valid`` marks (all when None); slots in [0, num_slots)."""
    mod = _kernels_for(cache, "kv_copy_triton")
    if mod is not None:
        with on_device(cache.device):
            mod.scatter_slots_triton(cache, slots, rows, valid)
    else:
        kv_copy_ref.scatter_slots_ref(cache, slots, rows, valid)


def route(router_logits, correction_bias, *, top_k, n_group=1, topk_group=1, renormalize=True,
          routed_scaling_factor=1.0):
    return moe_ref.route_ref(
        router_logits, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
    )


def fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, *, skipped: bool = False):
    """Sum_k w_k * down_e(silu(gate_e x) * up_e x) over each token's chosen experts -> [T, H].

    ``skipped``: some ids equal E (the stacked experts' count) -- expert parallelism's mark for
    another rank's expert -- and contribute nothing. The Triton kernel sorts them into a bucket of
    their own and writes zeros there, so a rank's share of a step needs no host read of which
    entries are its own (a sync per MoE layer on a GPU); on CPU they are dropped before the kernels.
    The weights may be ``BlockFP8`` stacks (kernels/block_fp8.py): the Triton kernel reads them as
    stored; the CPU paths dequantise the whole stacks first (for checks, not speed)."""
    mod = _kernels_for(x, "moe_triton")
    if mod is not None:  # the Triton kernel reads rows with unit stride: weights a CPU runner
        # re-laid column-major (expert_weight_layout) go back to row-major (a no-op otherwise)
        with on_device(x.device):
            return mod.fused_experts_triton(x, _row_major(w_gate_up), _row_major(w_down), topk_weights, topk_ids,
                                            skipped=skipped)
    # Without Triton: the C kernel while the experts see a few rows each, else two grouped matmuls
    # (kernels.cpu.moe; same math as the reference's loop).
    return _experts_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, skipped)


def _row_major(w):
    return w if isinstance(w, BlockFP8) else w.contiguous()


@torch.compiler.disable  # data-dependent shapes (sort, bincount, per-token expert ids): a compiled
def _experts_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, skipped=False):  # decode step runs it eagerly
    from kernels.cpu.moe import experts_cpu, experts_cpu_kept  # between graphs

    w_gate_up, w_down = (w.dequantize(x.dtype) if isinstance(w, BlockFP8) else w for w in (w_gate_up, w_down))
    return (experts_cpu_kept if skipped else experts_cpu)(x, w_gate_up, w_down, topk_weights, topk_ids)


def expert_weight_layout(w):
    """Stacked expert weights [E, N, K] in the memory layout :func:`fused_experts` reads fastest on
    their device (same shape and values): column-major per expert on CPU (the grouped GEMMs then read
    a contiguous operand), unchanged for the Triton kernel."""
    if use_triton(w):
        return w
    from kernels.cpu.moe import kernel_layout

    return kernel_layout(w)


def linear_weight_layout(w):
    """A linear weight [N, K] in the memory layout ``F.linear`` reads fastest on its device (same shape
    and values): column-major on CPU, so MKL reads W^T [K, N] as a plain row-major operand. A decode
    step's GEMMs are skinny (M = batch rows) over weights that do not stay in the cache between steps;
    read that way they stream faster (the LM head at 32 rows: 3.0 -> 2.5 ms; README, "Where a text step's
    time goes").
    Unchanged on CUDA."""
    if w.is_cuda:
        return w
    return w.t().contiguous().t()


def band_attention(q, k, v, cu_seqlens, *, scale, window=None, sinks=None):
    """Bidirectional varlen attention within each [cu_seqlens[i], cu_seqlens[i+1]) segment; with
    ``window`` a token sees only keys within ±window positions; optional per-head sinks."""
    mod = _kernels_for(q, "band_attention_triton")
    if mod is not None:
        with on_device(q.device):
            return mod.band_attention_triton(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)
    from kernels import band_attention_ref

    return band_attention_ref.band_attention_ref(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)
