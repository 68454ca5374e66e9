"""DraftSteps: the inputs of the k draft steps of mode "first", built once for all of them.

Draft step s of a request at pending position c is one row at position c + s, over the page tables
the scheduler already extended for 1 + k tokens; the request drafts while s < its k. Every step's
ForwardBatch fields are therefore slices of [S, B] grids computed in one go from step 0's batch:

    positions[s, b] = start_b + s          seq_lens = positions + 1
    slots[s, b]     = table[b, pos // P] * P + pos % P   (SWA: -1 where the page is released)

and so are the MTP layer's attention plans (ops.attention_decode_plans: one key grid for all steps)
and rotary tables (one ``rotary.tables`` call), which ``Attention.prime`` hands to each step's batch:
no per-step table building, host reads or plan construction. The batches equal what
``build_forward_batch`` makes for the same rows (tests/llm_core/engine/test_speculative.py).
"""

from __future__ import annotations

import torch

from kernels import ops
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.forward_batch import ForwardBatch
from llm_core.model.layers.attention import Attention


class DraftSteps:
    def __init__(self, entries: list[ScheduledRequest], first: ForwardBatch, attn: Attention,
                 dtype: torch.dtype) -> None:
        """``first``: build_forward_batch of one row per entry at its start (draft step 0)."""
        ks = [e.num_draft_tokens for e in entries]
        self.num_steps = max(ks)
        self.first, self.attn, self.dtype = first, attn, dtype
        device, page = first.positions.device, first.page_size
        step = torch.arange(self.num_steps, dtype=torch.long)
        self.rows = [[b for b, k in enumerate(ks) if k > s] for s in range(self.num_steps)]  # who drafts step s
        # every request drafting as many tokens (always so at batch 1): no inactive cells to mask
        self.active = None if min(ks) == self.num_steps else torch.tensor([[k > s for k in ks]
                                                                         for s in range(self.num_steps)])  # [S, B]
        self.lens = first.seq_lens[None, :] + step[:, None]  # [S, B] context after step s
        pos = first.positions[None, :] + step.to(device)[:, None]
        if self.active is not None:  # inactive: step 0's row (in range, its page is mapped)
            pos = torch.where(self.active.to(device), pos, first.positions[None, :])
        self.positions = pos
        page_idx, in_page = pos // page, pos % page
        full = first.full_block_table.gather(1, page_idx.T).T
        swa = first.swa_block_table.gather(1, page_idx.T).T
        self.full_slots = full * page + in_page
        self.swa_slots = torch.where(swa >= 0, swa * page + in_page, -1)
        # whether the layer's pool has a page for every row of every step: checked once, not per step
        self.slots_valid = bool(((self.swa_slots if attn.is_sliding else self.full_slots) >= 0).all())
        self.plans = ops.attention_decode_plans(torch.empty(0, dtype=dtype, device=device), first.swa_block_table
                                                if attn.is_sliding else first.full_block_table, self.lens,
                                                self.active, self.rows, page_size=page, window=attn.window)
        cos, sin = attn.rotary.tables(pos.reshape(-1), dtype)
        self.cos, self.sin = cos.view(self.num_steps, -1, *cos.shape[1:]), sin.view(self.num_steps, -1, *sin.shape[1:])
        self._index = [None if len(r) == len(entries) else torch.tensor(r, device=device) for r in self.rows]
        self._aranges: dict[int, torch.Tensor] = {}

    def kept(self, s: int) -> torch.Tensor | None:
        """Which rows of step s - 1 draft on at step s (None: all of them)."""
        if len(self.rows[s]) == len(self.rows[s - 1]):
            return None
        return torch.tensor([b in set(self.rows[s]) for b in self.rows[s - 1]], device=self.first.positions.device)

    def batch(self, s: int) -> ForwardBatch:
        """Step s's ForwardBatch, primed with its attention plan, rotary tables and slot check."""
        idx, f = self._index[s], self.first

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if idx is None else t[idx.to(t.device)]

        n = len(self.rows[s])
        fb = ForwardBatch(
            positions=pick(self.positions[s]),
            query_start_loc=self._arange(n + 1, torch.device("cpu")),
            seq_lens=pick(self.lens[s]),
            full_slot_mapping=pick(self.full_slots[s]),
            swa_slot_mapping=pick(self.swa_slots[s]),
            full_block_table=pick(f.full_block_table),
            swa_block_table=pick(f.swa_block_table),
            page_size=f.page_size,
            logits_indices=self._arange(n, f.positions.device),
        )
        # a step's rows are a subset of all steps' rows: all valid when all are
        self.attn.prime(fb, self.plans[s], (pick(self.cos[s]), pick(self.sin[s])), self.dtype,
                        slots_valid=True if self.slots_valid else None)
        return fb

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        """0 .. n - 1, one tensor per length and device for every step (never written in place)."""
        key = (n, device)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(n, dtype=torch.long, device=device)
        return self._aranges[key]
