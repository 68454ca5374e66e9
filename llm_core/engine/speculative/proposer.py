"""MTPProposer: keeps the MTP layers' KV in step with the target and drafts k tokens per request.

Rows (llm_core/model/mtp.py): MTP layer l's row q takes token t_q and the hidden state of row q - 1
one level down (level 0 = the target's final-normed hidden, level l + 1 = MTP layer l's output).

**Extend** (after every target forward, over exactly the target's rows, slots and page tables): layer
l's h_prev is level l shifted down one row inside each request; a request's first row takes the
*tail* kept from its previous step (level l at position start - 1), or zeros when that is unknown
(position 0, after a prefix-cache hit or a preemption: only draft quality suffers, never outputs).
Rows of rejected drafts are written too and simply rewritten by the next extend, like the target's.

**Draft** (before the verify forward, into pages the scheduler already allocated for 1 + k tokens),
c = position of the pending token t_c, d_0 = t_c:

    mode "first" (default, vLLM's and sglang's EAGLE use of MiMo MTP): layer 0 for every step
        step s: row c + s  <- (d_s, h_prev = step s - 1's output, or the level-0 tail for s = 0)
    mode "chain" (DeepSeek-V3's training order: depth s is layer s): step s runs layer s over rows
        c .. c + s  <- (d_0 .. d_s, h_prev = [level-s tail, step s - 1's outputs]); k <= #layers.
        Rows c .. c + s - 1 of layer s are what its KV lacks (the extend stops at c - 1).
    d_{s+1} = argmax lm_head(output at row c + s)

Drafts are greedy (a one-hot proposal): verification then only asks whether the plain sampler,
with its own noise row, would emit the draft (verify.py) -- exact, and a seed reproduces.

**Across ranks** (tensor / expert parallelism: the model is rank 0's ``MirroredModel``): every MTP
layer call and its logits go through the mirrored model (``mtp_layer``, ``mtp_logits``), so each
rank runs its shard of the layer over its share of the KV; the proposer's state (the tails) stays on
rank 0, which broadcasts each call's inputs -- a draft step's tokens travel as ids instead, and
every rank embeds them inside the call.
The folded-weight draft (fused_draft.py) is one process's only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from llm_core.engine.batch_builder import build_forward_batch
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.engine.speculative.draft_steps import DraftSteps
from llm_core.engine.speculative.fused_draft import FusedDraft
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.mtp import MTPHead

LAYER_MODES = ("first", "chain")


@dataclass
class _Tail:
    position: int  # the row these hidden states belong to
    levels: torch.Tensor  # [L, H], its own storage: level 0 = target, level l + 1 = MTP layer l


class MTPProposer:
    def __init__(self, model: torch.nn.Module, head: MTPHead, *, mode: str, max_draft: int, page_size: int) -> None:
        if mode not in LAYER_MODES:
            raise ValueError(f"speculative layer mode must be one of {LAYER_MODES}, got {mode!r}")
        self.model, self.head, self.mode, self.page_size = model, head, mode, page_size
        n = len(head.layers)
        self.max_draft = max_draft if mode == "first" else min(max_draft, n)
        self.num_layers = 1 if mode == "first" else self.max_draft  # layers that keep KV
        self.kv_base = model.config.num_layers  # MTP layer l uses pool layer kv_base + l
        self.hidden_size = model.config.hidden_size
        self._tails: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # rank 0 of a rank group: the MTP layers' calls mirrored to every rank (MirroredModel.mtp_layer)
        self.mirrored = callable(getattr(model, "mtp_layer", None))
        # mode "first": the draft from folded weights (fused_draft.py); None: DraftSteps + the module
        self.fused = None
        if mode == "first" and head.layers[0].self_attn.window is not None and not self.mirrored:
            self.fused = FusedDraft(head.layers[0], model.model.embed_tokens, model.lm_head, self.max_draft)
            with torch.inference_mode():
                self.fused.refresh()  # fold now (~3 ms on the demo model), not in the first request's step

    # ---- extend: MTP KV for the target's rows ---------------------------------------------------
    def extend(self, entries: list[ScheduledRequest], fb: ForwardBatch, embeds: torch.Tensor,
               hidden: torch.Tensor, kv, skip: set[int] = frozenset()) -> list[torch.Tensor]:
        """Run the MTP layers over the step's rows: their KV, and the outputs [T, H] of every layer
        but the last that keeps KV (a list one shorter than ``num_layers``). Nothing reads the last
        layer's outputs -- a draft step's h_prev at level l comes from layer l - 1 (mode "first": level
        0, the target's) -- so that layer only writes its K/V (MTPLayer.write_kv): no attention, MLP
        or final norm, the same KV bit for bit.

        Entries whose ``id`` is in ``skip`` (plain decodes of requests the adaptive draft length has
        at k = 0) are left out: their MTP KV goes stale, which only lowers their later acceptance
        (and such requests draft poorly anyway), while a large batch of them pays no MTP cost."""
        if skip and any(id(e) in skip for e in entries):
            keep = [e for e in entries if id(e) not in skip]
            outs = [torch.zeros_like(hidden) for _ in range(self.num_layers - 1)]
            if not keep:
                return outs
            qsl = fb.query_start_loc.tolist()
            rows = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b, e in enumerate(entries) if id(e) not in skip])
            rows = rows.to(hidden.device)
            sub_fb, _ = build_forward_batch(keep, self.page_size, hidden.device)
            for full, part in zip(outs, self.extend(keep, sub_fb, embeds[rows], hidden[rows], kv)):
                full[rows] = part
            return outs
        starts = fb.query_start_loc.tolist()[:-1]
        src, outs = hidden, []
        for l in range(self.num_layers):
            prev = torch.empty_like(src)
            prev[1:] = src[:-1]
            for b, e in enumerate(entries):
                prev[starts[b]] = self._tail(e.request, e.start - 1, l, src)
            if l == self.num_layers - 1:
                self._layer(l, embeds, prev, fb, kv, write_only=True)
                break
            src = self._layer(l, embeds, prev, fb, kv)
            outs.append(src)
        return outs

    def _layer(self, l: int, embeds: torch.Tensor | None, h_prev: torch.Tensor, fb: ForwardBatch, kv,
               write_only: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """MTP layer ``l`` over ``fb``'s rows (its K/V in pool layer kv_base + l): here, or on every
        rank of a group (``MirroredModel.mtp_layer``). ``write_only``: only its K/V. ``embeds`` None
        (across ranks, a draft step): every rank embeds the rows' ``ids`` inside the call."""
        if self.mirrored:
            return self.model.mtp_layer(l, self.kv_base + l, embeds, h_prev, fb, kv, write_only,
                                        input_ids=ids if embeds is None else None)
        k_cache, v_cache = kv.layer(self.kv_base + l)
        layer = self.head.layers[l]
        if write_only:
            return layer.write_kv(embeds, h_prev, fb, k_cache, v_cache)
        return layer(embeds, h_prev, fb, k_cache, v_cache)

    def _logits(self, out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last ``_layer`` output's ``rows`` (all when None); across ranks every rank
        computes its vocabulary slice of the same rows (``MirroredModel.mtp_logits``)."""
        if self.mirrored:
            return self.model.mtp_logits(out, rows)
        return self.model.compute_logits(out if rows is None else out[rows])

    def commit(self, request, position: int, row: int, hidden: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Keep the hidden states of ``row`` (the request's last computed position) for its next step.
        Copied (one stack): a view of ``hidden[row]`` would keep the whole step's [T, H] tensors
        alive -- a prefill step's, for as long as an idle request (which commits no newer tail) runs."""
        self._tails[request] = _Tail(position, torch.stack([hidden[row], *(o[row] for o in outs)]))

    def _tail(self, request, position: int, level: int, like: torch.Tensor) -> torch.Tensor:
        tail = self._tails.get(request)
        if tail is None or tail.position != position or position < 0 or level >= len(tail.levels):
            return torch.zeros(self.hidden_size, dtype=like.dtype, device=like.device)
        return tail.levels[level]

    # ---- draft ----------------------------------------------------------------------------------
    def draft(self, entries: list[ScheduledRequest], kv) -> None:
        """Append ``e.num_draft_tokens`` greedy draft tokens to each entry's ``request.token_ids``
        (the caller removes them after the verify forward)."""
        if not entries:
            return
        if self.fused is not None:
            return self._draft_fused(entries, kv)
        if self.mode == "first":
            return self._draft_first(entries, kv)
        return self._draft_rows(entries, kv)

    def _draft_rows(self, entries: list[ScheduledRequest], kv) -> None:
        """Either mode, each step's batch built from its rows (build_forward_batch): the chain mode's
        draft, and the reference the first mode's fast path is tested against."""
        prev: dict[int, torch.Tensor] = {}
        for s in range(max((e.num_draft_tokens for e in entries), default=0)):
            active = [e for e in entries if e.num_draft_tokens > s]
            layer = 0 if self.mode == "first" else s
            if self.mode == "first":
                sub = [ScheduledRequest(e.request, e.start + s, 1) for e in active]
            else:
                sub = [ScheduledRequest(e.request, e.start, s + 1) for e in active]
            fb, ids = build_forward_batch(sub, self.page_size, ids_device(self.model))
            embeds = None if self.mirrored else self.model.embed(ids)  # across ranks: in the MTP call
            like = self.head.layers[layer].eh_proj.weight  # the model's dtype and device
            rows = []
            for e in active:
                tail = self._tail(e.request, e.start - 1, layer, like)[None]
                if s == 0:
                    rows.append(tail)
                elif self.mode == "first":
                    rows.append(prev[id(e)][-1:])
                else:
                    rows.append(torch.cat([tail, prev[id(e)]]))
            out = self._layer(layer, embeds, torch.cat(rows), fb, kv, ids=ids)
            ends = fb.query_start_loc.tolist()
            tokens = self._logits(out, torch.tensor(ends[1:], device=out.device) - 1).argmax(-1).tolist()
            for b, e in enumerate(active):
                prev[id(e)] = out[ends[b]:ends[b + 1]]
                e.request.token_ids.append(int(tokens[b]))

    def _draft_fused(self, entries: list[ScheduledRequest], kv) -> None:
        """Mode "first" from folded weights (fused_draft.py): every request runs the longest k's
        steps (rows are nearly free next to the dispatches) and keeps its own first k tokens."""
        like = self.fused.layer.eh_proj.weight
        if len(entries) == 1:
            h_prev = self._tail(entries[0].request, entries[0].start - 1, 0, like)
        else:
            h_prev = torch.stack([self._tail(e.request, e.start - 1, 0, like) for e in entries])
        k_cache, v_cache = kv.layer(self.kv_base)
        drafted = self.fused.draft([e.request.token_ids[e.start] for e in entries], [e.start for e in entries], h_prev,
                                   [e.request.swa_pages for e in entries], self.page_size, k_cache, v_cache,
                                   max(e.num_draft_tokens for e in entries))
        for e, tokens in zip(entries, drafted):
            e.request.token_ids.extend(tokens[:e.num_draft_tokens])

    def _draft_first(self, entries: list[ScheduledRequest], kv) -> None:
        """Mode "first": every draft step is one row per request still drafting, at the next position,
        over the same page tables, so the steps' inputs are built once for all k steps (positions,
        slots, attention plans, rotary tables: draft_steps.py) and each step only slices them. The
        drafted tokens stay on the device until the last step (one host read for the whole draft)."""
        fb0, ids = build_forward_batch([ScheduledRequest(e.request, e.start, 1) for e in entries], self.page_size,
                                       ids_device(self.model))
        # sampled or argmax ids, always in the vocabulary: no checked embed (a host read) in one
        # process; across ranks every rank embeds them inside the MTP call (the checked one)
        def embed(t: torch.Tensor) -> torch.Tensor | None:
            return None if self.mirrored else self.model.model.embed_tokens(t)

        embeds = embed(ids)
        like = self.head.layers[0].eh_proj.weight  # the model's dtype and device
        steps = DraftSteps(entries, fb0, self.head.layers[0].self_attn, like.dtype)
        h_prev = torch.stack([self._tail(e.request, e.start - 1, 0, like) for e in entries])
        drafted: list[torch.Tensor] = []
        for s in range(steps.num_steps):
            if s:
                keep = steps.kept(s)
                h_prev, tokens = (out, tokens) if keep is None else (out[keep], tokens[keep])
                ids, embeds = tokens, embed(tokens)
            out = self._layer(0, embeds, h_prev, steps.batch(s), kv, ids=ids)
            tokens = self._logits(out).argmax(-1)
            drafted.append(tokens)
        tokens_in_order = iter(torch.cat(drafted).tolist())  # step-major, like steps.rows
        for rows in steps.rows:
            for b in rows:
                entries[b].request.token_ids.append(next(tokens_in_order))


def ids_device(model: torch.nn.Module) -> torch.device:
    return model.model.embed_tokens.weight.device
