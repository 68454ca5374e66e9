"""Fixed-shape decode steps per batch bucket: eager, torch.compile'd (CPU, inductor) or CUDA graphs.

A decode-only step of n requests runs as a step of B rows, B the smallest bucket >= n (rows of the
persistent batch, persistent_batch.py; the rest is padding). Every tensor of the step then has a
shape fixed by B alone -- ids, positions, slot maps [B], page tables [B, max_pages] -- and, on
CPU, the attention key grids [B, K] with K a power of two >= the longest context (masked padding
past each row's own keys, kernels/cpu/attention_plan.py), so a step's graph never depends on the
exact lengths:

    mode        what runs                                   graphs
    eager       the model on the fixed-shape inputs         none (the "enforce eager" reference)
    compile     torch.compile(inductor, dynamic=False)      one per (B, K) seen; the B at K_min are
                                                            compiled at start-up (warm_up)
    cudagraph   torch.cuda.graph capture per B, replay      one per (B, key splits) (the Triton
                over static buffers (as nano-vllm / vLLM)   kernels take the lengths as data: no K)

Key splits under CUDA graphs: a decode step's attention splits each (request, KV head) program's
keys into chunks so a few requests with long contexts still fill the GPU (flash-decoding). The
kernels choose the split count on the host from the longest context, which a captured step cannot
read (its lengths are on the device). So the step tells them K (``ForwardBatch.decode_keys``) and
each bucket is captured once per split count that K gives (``ops.decode_splits``: a power of two
<= 16, so at most five graphs per bucket, sharing one memory pool); a step replays the graph of its
own K's splits. The count is fixed per graph, not the chunks: every request cuts its own key range
into that many in the kernel, so a shorter context under a graph of many splits stays exact. Every
bucket's graphs for every K up to ``max_model_len`` are captured at start-up (padding rows only: the
count depends on K, not on the rows), so no step pauses mid-serving for a capture or a kernel
compile.

MTP verify steps replay the same graphs (``forward_rows``): each new token of a verify entry is a
decode row of its own over its causal prefix (step_rows.VerifyRows), and the step returns the
final-normed hidden states beside the logits, which the MTP extend reads.

What stays eager inside a compiled step: the experts (data-dependent sort / bincount; ``kernels.ops``
marks them), so a compiled step is a few graphs per layer joined by eager expert calls. Sampling and
the input preparation stay outside the graphs. The CUDA-graph path has not been run on a GPU yet
(no device in its sessions); it is only taken on CUDA and falls back to eager when capture fails.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

from kernels import ops
from llm_core.engine.fixed_decode.persistent_batch import PersistentDecodeBatch
from llm_core.engine.fixed_decode.step_rows import VerifyRows, slot_mappings
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

DECODE_MODES = ("eager", "compile", "cudagraph")
# Each (bucket, keys) shape adds one entry per compiled frame (the step's graphs are joined by eager
# expert calls, so layers share frames): dynamo's default limit of 8 would turn later shapes eager.
RECOMPILE_LIMIT = 256
MIN_KEYS = 256  # the narrowest key grid: shorter contexts share it (and the graphs warm_up compiles)


class CaptureFailed(RuntimeError):
    """``torch.cuda.graph`` could not capture a step (its eager launch just before had run whole)."""


class _LayerKV:
    """The step's (k_cache, v_cache) per layer, fetched once before the graph (a prefix-cache view
    may wait for tier loads in ``layer``; that wait must not sit inside a compiled region)."""

    def __init__(self, kv, num_layers: int) -> None:
        self.buffers = tuple(kv.layer(i) for i in range(num_layers))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[i]


class DecodeGraphs:
    """Runs decode-only steps of up to ``max(buckets)`` requests through fixed-shape graphs."""

    def __init__(self, model: torch.nn.Module, pool, *, buckets: tuple[int, ...], mode: str,
                 max_model_len: int, scratch: tuple[int, int] | None = None,
                 mirror: Callable[[int, object, Callable[[], tuple]], tuple] | None = None,
                 agree: Callable[[bool], bool] | None = None,
                 splits: dict[tuple[int, int], tuple[int, ...]] | None = None) -> None:
        """``model``: this process's model (a rank's shard). In a tensor-parallel group, on every
        rank: ``scratch``, rank 0's scratch pages (the other ranks take no pages of their own), and
        ``agree(ok)``, whether every rank's last capture succeeded (each rank's own outcome in: a
        gather); on rank 0 ``mirror(bucket, rows, run)`` runs ``run``, the local step, after telling
        the other ranks to make the same step on ``rows`` (step_mirror.py); ``splits``, rank 0's key
        splits per (bucket, key width), so every rank captures the same graphs. A group's ranks must
        make the same steps (their collectives meet), so one rank cannot fall back to eager steps
        alone: after each start-up capture the ranks agree, and if any failed, all run eagerly."""
        if mode not in DECODE_MODES:
            raise ValueError(f"decode mode {mode!r}; expected one of {DECODE_MODES}")
        self.model, self.mode, self.mirror, self.agree = model, mode, mirror, agree
        self._capture_error: Exception | None = None  # a group's rank: its last capture's failure
        self._warming = False  # in warm_up: where a group's captures happen
        self.buckets = tuple(sorted(set(buckets)))
        self.page_size = pool.page_size
        self.device = pool.device
        self.num_layers = len(pool.layout.layer_kinds)
        self.max_keys = -(-max_model_len // self.page_size) * self.page_size
        if scratch is None:  # one page per pool that padded rows write and read, never a request's
            scratch = (pool.full.allocate(1)[0], pool.swa.allocate(1)[0] if pool.swa.num_pages else -1)
        self.scratch = scratch
        self.max_pages = self.max_keys // self.page_size + 1
        self.batch = PersistentDecodeBatch(self.buckets[-1], self.max_pages, self.page_size, self.scratch)
        self.verify_rows = VerifyRows(self.buckets[-1], self.max_pages, self.page_size, self.scratch)
        self.steps = 0  # the runner's step counter (every step, eager ones too: see note_step)
        self.compile_seconds = 0.0
        self._compiled = torch.compile(self._logits, backend="inductor", dynamic=False) if mode == "compile" else None
        self._shapes: set[tuple[int, int]] = set()  # (bucket, keys) compiled so far
        # (bucket, key splits per attention kind) -> (graph, static inputs, (logits, hidden))
        self._graphs: dict[tuple[int, tuple[int, ...]], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self._graph_pool = None  # one memory pool for every graph: they never run at once
        # the (KV heads, window) of each attention kind: what the kernels' key splits depend on
        self._attention_kinds = tuple(dict.fromkeys(
            (layer.self_attn.spec.num_kv_heads, layer.self_attn.window) for layer in model.model.layers))
        self._splits: dict[tuple[int, int], tuple[int, ...]] = {}  # (bucket, keys) -> key_splits
        if splits is not None:  # a group's rank: rank 0's (the same captures on every rank, whatever its SMs)
            self._splits.update(splits)

    # ---- public API -------------------------------------------------------------------------
    def note_step(self) -> None:
        """Count a step of the runner (the persistent batch rewrites rows that missed one)."""
        self.steps += 1

    def supports(self, entries: list[ScheduledRequest]) -> bool:
        """Whether ``entries`` is a decode step this runner takes: one new token each, no spliced
        embedding row, and no more requests than the largest bucket."""
        return len(entries) <= self.buckets[-1] and all(
            e.num_new_tokens == 1 and (e.request.embeds is None or e.start >= e.request.num_prompt_tokens)
            for e in entries)

    def supports_rows(self, entries: list[ScheduledRequest]) -> bool:
        """Whether ``forward_rows`` takes ``entries``: every entry past its prompt (decodes and MTP
        verifies: no spliced embedding row, no prompt logprobs), their new tokens fitting a bucket.
        Not under torch.compile (CPU): there a verify step's few rows run faster through the C
        kernels' short-row path than through the compiled step's padded key grid."""
        return (self.mode != "compile" and bool(entries) and sum(e.num_new_tokens for e in entries) <= self.buckets[-1]
                and all(e.start >= e.request.num_prompt_tokens for e in entries))

    @torch.inference_mode()
    def forward(self, entries: list[ScheduledRequest], kv) -> torch.Tensor:
        """Logits [n, V] of the entries (in entry order), one fixed-shape step of the smallest bucket."""
        rows = self.batch.update(entries, self.steps)
        bucket = self.buckets[bisect.bisect_left(self.buckets, len(entries))]
        logits, _ = self._step(bucket, kv, self.batch)
        return logits[torch.tensor(rows, device=logits.device)]

    @torch.inference_mode()
    def forward_rows(self, entries: list[ScheduledRequest], kv) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V], final-normed hidden states [R, hidden]) of every new token of ``entries``
        (R of them, in entry order: the ragged layout's rows), one fixed-shape step of the smallest
        bucket >= R with each token a decode row of its own (``VerifyRows``): an MTP verify step
        replays the same graphs as plain decoding. The hidden states are a copy (the MTP head keeps
        tails of them); the logits are a view valid until the next replay rewrites the graph's output
        buffers -- the caller gathers its rows from them at once."""
        n = self.verify_rows.fill(entries)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        logits, hidden = self._step(bucket, kv, self.verify_rows)
        return logits[:n], hidden[:n].clone()

    @torch.inference_mode()
    def step_rows(self, bucket: int, rows, kv) -> None:
        """A rank other than 0: rank 0's step of ``bucket`` ``rows`` (a StepRows) on this rank's
        shard and KV share (its outputs are rank 0's: the logits are gathered there)."""
        self._run(bucket, _LayerKV(kv, self.num_layers), source=rows.widened(self.max_pages))

    def warm_up(self, kv) -> float:
        """Compile every bucket at the narrowest key grid (CPU), or capture every bucket's graph of
        each key-split count its contexts can need (CUDA), on padding rows only; returns the seconds
        it took."""
        if self.mode == "eager":
            return 0.0
        t0 = time.perf_counter()
        layers = _LayerKV(kv, self.num_layers)
        self._warming = True
        try:
            with torch.inference_mode():
                for b in self.buckets:
                    if self.mode != "cudagraph":
                        self._run(b, layers)
                        continue
                    first_width: dict[tuple[int, ...], int] = {}  # split count -> the narrowest width needing it
                    for keys in self._key_widths():
                        first_width.setdefault(self.key_splits(b, keys), keys)
                    for keys in first_width.values():
                        if self.mode == "cudagraph":  # not after a failed capture (then every step runs eagerly)
                            self._run(b, layers, min_keys=keys)
                            self._settle_group_capture()
        finally:
            self._warming = False
        return time.perf_counter() - t0

    def _settle_group_capture(self) -> None:
        """In a group, after a start-up capture: if any rank's failed, every rank runs eagerly."""
        if self.agree is None:
            return
        failed, self._capture_error = self._capture_error, None
        if not self.agree(failed is None):
            log.warning("CUDA graph capture failed on %s; every rank decodes eagerly",
                        f"this rank ({failed})" if failed is not None else "another rank")
            self.mode = "eager"
            self._graphs.clear()

    # ---- internal helpers -------------------------------------------------------------------
    def _step(self, bucket: int, kv, source) -> tuple[torch.Tensor, torch.Tensor]:
        """A serving step over ``source``'s first ``bucket`` rows (mirrored to a group's ranks)."""
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            return self._run(bucket, _LayerKV(kv, self.num_layers), source=source)

        return run() if self.mirror is None else self.mirror(bucket, source, run)

    def _run(self, bucket: int, kv: _LayerKV, min_keys: int = MIN_KEYS, source=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden) of the first ``bucket`` rows of ``source`` (the persistent batch unless
        given: a VerifyRows)."""
        source = self.batch if source is None else source
        if self.mode == "cudagraph":
            with ops.on_device(self.device):  # capture and replay use the current device's streams
                return self._replay(bucket, kv, min_keys, source)
        ids, fb, keys = self._inputs(bucket, source=source)
        if self._compiled is None:
            return self._logits(ids, fb, kv)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            if (bucket, keys) in self._shapes:
                return self._compiled(ids, fb, kv)
            t0 = time.perf_counter()  # the first call of a shape compiles its graphs
            out = self._compiled(ids, fb, kv)
        self._shapes.add((bucket, keys))
        self.compile_seconds += time.perf_counter() - t0
        return out

    def _logits(self, ids: torch.Tensor, fb: ForwardBatch, kv: _LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The step: (logits, the final-normed hidden states they came from) of every row."""
        hidden = self.model(None, fb, kv, inputs_embeds=self.model.model.embed_tokens(ids))
        return self.model.compute_logits(hidden), hidden

    def split_table(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Every (bucket, key width) a step can have and its key splits (what a group's other ranks
        are given: ``splits``)."""
        return {(b, k): self.key_splits(b, k) for b in self.buckets for k in self._key_widths()}

    def _key_widths(self) -> list[int]:
        """The key widths a step can have: powers of two from MIN_KEYS, the last capped at max_keys."""
        widths, k = [], MIN_KEYS
        while True:
            widths.append(min(k, self.max_keys))
            if k >= self.max_keys:
                return widths
            k *= 2

    def _inputs(self, bucket: int, min_keys: int = MIN_KEYS, source=None) -> tuple[torch.Tensor, ForwardBatch, int]:
        """The first ``bucket`` rows of ``source`` (the persistent batch unless given) as (ids,
        ForwardBatch, key width): the width a power of two (at least ``min_keys``: the start-up
        captures' widths); eager and compiled steps get the tensors on the device and the attention
        plans of both pools built here, once, at that width (masked past each row's keys); a
        CUDA-graph replay gets them on the host, no plans (its graph has them)."""
        b, dev = self.batch if source is None else source, self.device
        graph = self.mode == "cudagraph"
        # a replay copies the inputs into its static buffers itself, without blocking; a plain
        # .to(device) here would synchronize the stream once per tensor
        def to(t: torch.Tensor) -> torch.Tensor:
            return t if graph else t.to(dev)

        full_slots, swa_slots = slot_mappings(b, bucket)
        seq_lens = torch.from_numpy(b.seq_lens[:bucket]).clone()
        fb = ForwardBatch(
            positions=to(torch.from_numpy(b.positions[:bucket])),
            query_start_loc=torch.arange(bucket + 1),
            seq_lens=seq_lens,
            full_slot_mapping=to(torch.from_numpy(full_slots)),
            swa_slot_mapping=to(torch.from_numpy(swa_slots)),
            full_block_table=to(torch.from_numpy(b.full_table[:bucket])),
            swa_block_table=to(torch.from_numpy(b.swa_table[:bucket])),
            page_size=self.page_size,
            logits_indices=torch.arange(bucket, device=None if graph else dev),  # a replay reads none
            slots_all_valid=True,
        )
        keys = min(max(min_keys, 1 << (int(seq_lens.max()) - 1).bit_length()), self.max_keys)
        if graph:  # a replay reads only the inputs (plans and tables are in the graph)
            return torch.from_numpy(b.token_ids[:bucket]), fb, keys
        dtype = self.model.model.norm.weight.dtype
        q = torch.empty(0, dtype=dtype, device=dev)  # the plan reads q's dtype and device only
        plans, tables = {}, {}
        for layer in self.model.model.layers:  # every layer's plan and rotary tables set before the
            attn = layer.self_attn  # graph: the step_cache then looks the same to every layer's guards
            pk, rk = (attn.is_sliding, attn.window), (attn.rotary.rotary_dim, attn.rotary.theta)
            if pk not in plans:
                table = fb.swa_block_table if attn.is_sliding else fb.full_block_table
                width = keys if attn.window is None else min(keys, attn.window)
                plans[pk] = ops.attention_plan(q, table, fb.query_start_loc, seq_lens, page_size=self.page_size,
                                               window=attn.window, keys=width)
            if rk not in tables:
                tables[rk] = attn.rotary.tables(fb.positions, dtype)
            attn.prime(fb, plans[pk], tables[rk], dtype)
        return torch.from_numpy(b.token_ids[:bucket]).to(dev), fb, keys

    def key_splits(self, bucket: int, keys: int) -> tuple[int, ...]:
        """The attention kernels' key splits, per attention kind, in a decode step of ``bucket`` rows
        whose contexts are at most ``keys`` tokens (1 each off CUDA): what a graph is captured with."""
        hit = self._splits.get((bucket, keys))
        if hit is None:
            q = torch.empty(0, device=self.device)  # the rule reads q's device only
            hit = self._splits[(bucket, keys)] = tuple(
                ops.decode_splits(q, bucket, kv_heads, window, keys) for kv_heads, window in self._attention_kinds)
        return hit

    def _replay(self, bucket: int, kv: _LayerKV, min_keys: int = MIN_KEYS, source=None):
        """CUDA: capture the bucket's eager step once per key-split count over static input buffers,
        then copy this step's inputs into them and replay. Falls back to eager when capture fails."""
        ids, fb, keys = self._inputs(bucket, min_keys, source)
        key = (bucket, self.key_splits(bucket, keys))
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(ids, fb, kv, keys)
            except Exception as exc:  # noqa: BLE001 -- a kernel that cannot be captured: stay eager
                if self.agree is not None:
                    # a group's rank: running this step eagerly would make its collectives once more
                    # than the other ranks; the ranks agree on eager steps after the capture instead.
                    # Only a failed capture is agreed on: an eager launch that failed part-way left
                    # this rank's collectives out of step with the others', an error for the group
                    if not isinstance(exc, CaptureFailed) or not self._warming:
                        raise
                    self._capture_error = exc
                    return None
                log.warning("CUDA graph capture of decode bucket %d (key splits %s) failed (%s); running it "
                            "eagerly", bucket, key[1], exc)
                self.mode = "eager"
                return self._run(bucket, kv, min_keys, source)  # its inputs built on the device this time
            log.info("captured the CUDA graph of decode bucket %d for contexts up to %d tokens (key splits %s)",
                     bucket, keys, key[1])
        graph, static, out = self._graphs[key]
        if self._warming and self.agree is not None:
            # a group's start-up: no replay before the ranks agree the capture held on every rank
            # (a rank whose capture failed replays nothing: the others' replayed collectives would
            # then be a step ahead of it)
            return out
        static["ids"].copy_(ids, non_blocking=True)
        for name in ("positions", "full_slot_mapping", "swa_slot_mapping", "full_block_table", "swa_block_table"):
            static[name].copy_(getattr(fb, name), non_blocking=True)
        static["seq_lens"].copy_(fb.seq_lens, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, ids: torch.Tensor, fb: ForwardBatch, kv: _LayerKV, keys: int):
        # lengths on the device too: the Triton attention then reads them there (no host copy inside
        # the capture; its host-side length checks are skipped, and it splits keys by ``keys``)
        static = {"ids": ids.to(self.device, copy=True), "seq_lens": fb.seq_lens.to(self.device, copy=True),
                  "qsl": fb.query_start_loc.to(self.device)}
        for name in ("positions", "full_slot_mapping", "swa_slot_mapping", "full_block_table", "swa_block_table"):
            static[name] = getattr(fb, name).to(self.device, copy=True)
        sfb = ForwardBatch(positions=static["positions"], query_start_loc=static["qsl"],
                           seq_lens=static["seq_lens"], full_slot_mapping=static["full_slot_mapping"],
                           swa_slot_mapping=static["swa_slot_mapping"], full_block_table=static["full_block_table"],
                           swa_block_table=static["swa_block_table"], page_size=self.page_size,
                           logits_indices=fb.logits_indices.to(self.device), slots_all_valid=True,
                           decode_keys=keys)
        self._logits(static["ids"], sfb, kv)  # warm-up launch outside capture (Triton autotune/JIT)
        torch.cuda.synchronize(self.device)
        # The warm-up filled sfb's step cache (rotary tables from the capture-time positions, ...):
        # left there, the capture would find them and the graph would read those tensors -- stale
        # positions, then freed memory -- on every replay instead of computing them from the static
        # positions inside the graph.
        sfb.step_cache.clear()
        static["batch"] = sfb  # every tensor the graph reads stays alive with the graph
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # thread_local: other threads of the process (an omni engine's media workers and encoder)
        # keep allocating and synchronizing their own streams while this thread captures; in the
        # default "global" mode any such call fails in that thread and invalidates this capture.
        # One pool for all graphs (as vLLM): they replay one at a time on this thread's stream, so
        # one graph's scratch may be another's output block -- safe because forward() and
        # forward_rows() (and its caller) take each replay's outputs on that stream before any other
        # graph replays.
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                out = self._logits(static["ids"], sfb, kv)
        except BaseException as exc:
            # a capture that failed can leave this thread on the capture's side stream (torch's
            # graph context ends the capture before it restores the stream, and that end raises):
            # the eager steps that follow must run on the stream they ran on before
            torch.cuda.set_stream(stream)
            if isinstance(exc, Exception):  # the capture alone failed (the eager launch above ran whole)
                raise CaptureFailed(str(exc)) from exc
            raise
        return graph, static, out

    def release(self) -> None:
        """Destroy the captured graphs (and their memory pool) now. In a rank group this must come
        before the process group's destroy or abort: NCCL (>= 2.26) waits there until every graph
        that captured one of its collectives is gone, so a graph still alive hangs the close."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._graph_pool = None
        self.mode = "eager" if self.mode == "cudagraph" else self.mode
