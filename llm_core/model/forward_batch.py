"""The typed contract between the scheduler/engine and the model for one forward step.

The engine flattens the new tokens of every scheduled request into one sequence of T tokens
(request order = order of ``query_start_loc``) and tells the model where each token's K/V goes in
each pool and which pages hold each request's context:

    request b:  tokens [query_start_loc[b], query_start_loc[b+1]) of the flat batch,
                positions seq_lens[b] - n_b .. seq_lens[b] - 1   (n_b = its new tokens)

Full pool: every logical page of the request is mapped.  SWA pool: only pages that hold keys some
query may still see are mapped; pages wholly behind the window are -1 (released).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    query_start_loc: torch.Tensor  # [B+1] int64 (CPU), cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64 (CPU), context length per request after this step
    full_slot_mapping: torch.Tensor  # [T] int64, Full-pool slot for each new token's K/V
    swa_slot_mapping: torch.Tensor  # [T] int64, SWA-pool slot for each new token's K/V
    full_block_table: torch.Tensor  # [B, max_full_pages] int64, -1 padded
    swa_block_table: torch.Tensor  # [B, max_logical_pages] int64, -1 = released / unmapped
    page_size: int
    # Rows of the flat batch whose hidden state must become logits (last token of each request
    # that samples this step); the model returns hidden states, the engine picks these rows.
    logits_indices: torch.Tensor  # [R] int64
    # True when no slot mapping holds -1 (a fixed-shape decode step: padded rows write a scratch
    # page), so the KV store needs no check -- a host sync a compiled step cannot hold.
    slots_all_valid: bool = False
    # True: the caller wants the hidden states of the logits rows only. The last layer then stores
    # every row's K/V (later steps read them) but computes attention, MLP and the final norm for the
    # logits rows alone, and the model returns [R, hidden] in logits_indices order (logits_hidden).
    # In a prompt chunk that is one row of T: ~1/L of the step saved for an L-layer model.
    logits_only: bool = False
    # True: logits_indices is exactly 0 .. T-1 (every row samples, e.g. an all-decode step), so
    # logits_hidden hands the hidden states over as they are instead of gathering every row.
    logits_every_row: bool = False
    # A decode step whose lengths live on the device (a CUDA-graph step: reading them on the host
    # would sync and cannot be captured) sets the host-known bound of its contexts here; the
    # attention kernels pick their key splits from it (kernels.ops.decode_splits).
    decode_keys: int | None = None
    # Per-step memo the model fills lazily with values derived only from the fields above (attention
    # index plans per pool and window, rotary tables per theta), so every layer of a kind reuses them.
    # Never invalidated: a ForwardBatch lives for one step and its tensors are not written in place --
    # except a CUDA graph's captured batch, whose static tensors every replay rewrites: its capture
    # starts from an empty cache, so the graph computes these values itself (decode_graphs.py).
    step_cache: dict = field(default_factory=dict, compare=False, repr=False)

    def logits_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits rows of the model's output (already those rows alone when ``logits_only``)."""
        return hidden if self.logits_only or self.logits_every_row else hidden[self.logits_indices]

    def logits_batch(self) -> ForwardBatch:
        """The logits rows as a batch of their own: one decode row per request that samples, at its
        last new token, over the same pages (its K/V is in the pool once the layer stored it). Memoised.

            flat rows   [a0 a1 a2 a3 | b0 | c0 c1 c2]   logits_indices [3, 4, 7]
            requests      0            1    2          -> rows of requests 0, 1, 2, each 1 new token
        """
        hit = self.step_cache.get("logits_batch")
        if hit is None:
            rows = self.logits_indices
            requests = torch.searchsorted(self.query_start_loc[1:], rows.cpu(), right=True)
            on_device = requests.to(self.full_block_table.device)
            hit = self.step_cache["logits_batch"] = ForwardBatch(
                positions=self.positions[rows], query_start_loc=torch.arange(rows.shape[0] + 1),
                seq_lens=self.seq_lens[requests], full_slot_mapping=self.full_slot_mapping[rows],
                swa_slot_mapping=self.swa_slot_mapping[rows], full_block_table=self.full_block_table[on_device],
                swa_block_table=self.swa_block_table[on_device], page_size=self.page_size,
                logits_indices=torch.arange(rows.shape[0], device=rows.device), slots_all_valid=self.slots_all_valid,
                decode_keys=self.decode_keys)
        return hit

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])
