"""The model runner's input preparation: a ScheduledBatch's entries become the model's ForwardBatch
(flat tokens, slot mappings, page tables) and, for requests with an EmbeddingSource, input
embeddings with the placeholder rows spliced in.

Slot of a token at logical position ``pos`` of request b, in either pool:

    page = table[b, pos // page_size]          (-1 in the SWA table: released)
    slot = page * page_size + pos % page_size

    e.g. page_size 4, full_pages [7, 2]:  pos 5 -> page 2, offset 1 -> slot 9
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.host_index import long_tensor
from llm_core.model.forward_batch import ForwardBatch
from llm_core.engine.scheduled_batch import ScheduledRequest


def page_table(rows: list[list[int]], width: int) -> torch.Tensor:
    """Page lists as one [rows, width] table, padded with -1 (no page)."""
    return long_tensor([r + [-1] * (width - len(r)) for r in rows])


# Up to this many new tokens a step's slots are worked out in Python ints (a few per token), beyond it
# by the ~10 tensor ops of :func:`chunk_slots`, whose fixed cost a short step does not repay: a decode
# batch, an MTP verify step, or the ~30 rows a prefix-cache hit leaves to prefill (each op's dispatch
# there runs with the caches cold, ~20-100 us apiece on the 2-core host, against ~0.3 us a token here)
PYTHON_SLOTS_MAX_TOKENS = 256


def slot_values(entries: list[ScheduledRequest], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(positions, Full slots, SWA slots) as Python ints of every new token of the entries; a slot is
    page * page_size + offset, -1 on a released SWA page (the values of :func:`chunk_slots`)."""
    positions: list[int] = []
    full: list[int] = []
    swa: list[int] = []
    for e in entries:
        full_pages, swa_pages = e.request.full_pages, e.request.swa_pages
        for pos in range(e.start, e.end):
            page, offset = divmod(pos, page_size)
            full.append(full_pages[page] * page_size + offset)
            swa_page = swa_pages[page]
            swa.append(swa_page * page_size + offset if swa_page >= 0 else -1)
        positions.extend(range(e.start, e.end))
    return positions, full, swa


def token_slots(entries: list[ScheduledRequest], page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`slot_values` as tensors (the caller keeps this to short steps: PYTHON_SLOTS_MAX_TOKENS)."""
    return tuple(long_tensor(v) for v in slot_values(entries, page_size))


def chunk_slots(entries: list[ScheduledRequest], counts: list[int], full_table: torch.Tensor,
                swa_table: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, full slots, SWA slots) [T] of every new token of the entries (any chunk sizes)."""
    # position of each flat token: its request's start + its offset inside the request's chunk
    positions = torch.cat([torch.arange(e.start, e.end) for e in entries])
    row = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor(counts, dtype=torch.long))
    page_idx, in_page = positions // page_size, positions % page_size
    full_slots = full_table[row, page_idx] * page_size + in_page
    swa_pages = swa_table[row, page_idx]
    return positions, full_slots, torch.where(swa_pages >= 0, swa_pages * page_size + in_page, -1)


def build_forward_batch(
    entries: list[ScheduledRequest], page_size: int, device: torch.device, logits_only: bool = False
) -> tuple[ForwardBatch, torch.Tensor]:
    """(ForwardBatch, input_ids [T]) for the scheduled entries, in entry order. ``logits_only``: the
    caller needs the hidden states of the sampling rows only (``ForwardBatch.logits_only``; set
    when they are fewer than the rows).

    Index tensors stay on the CPU where the contract says so (query_start_loc, seq_lens); the ones the
    model indexes device memory with go to ``device``.
    """
    counts = [e.num_new_tokens for e in entries]
    qsl = [0]
    for n in counts:
        qsl.append(qsl[-1] + n)
    ids: list[int] = []
    for e in entries:
        ids.extend(e.request.token_ids[e.start : e.end])

    width = max(len(e.request.full_pages) for e in entries)
    full_table = page_table([e.request.full_pages for e in entries], width)
    swa_table = page_table([e.request.swa_pages for e in entries], width)

    if len(ids) <= PYTHON_SLOTS_MAX_TOKENS:
        positions, full_slots, swa_slots = token_slots(entries, page_size)
    else:
        positions, full_slots, swa_slots = chunk_slots(entries, counts, full_table, swa_table, page_size)

    sample_rows = [qsl[b + 1] - 1 for b, e in enumerate(entries) if e.samples]
    batch = ForwardBatch(
        positions=positions.to(device),
        query_start_loc=long_tensor(qsl),
        seq_lens=long_tensor([e.end for e in entries]),
        full_slot_mapping=full_slots.to(device),
        swa_slot_mapping=swa_slots.to(device),
        full_block_table=full_table.to(device),
        swa_block_table=swa_table.to(device),
        page_size=page_size,
        logits_indices=long_tensor(sample_rows).to(device),
        logits_only=logits_only and len(sample_rows) < len(ids),
        # one sampling row per flat row, ascending: they are 0 .. T-1
        logits_every_row=len(sample_rows) == len(ids),
    )
    return batch, long_tensor(ids).to(device)


def splice_embeds(
    entries: list[ScheduledRequest], input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """Token embeddings [T, H] with placeholder rows replaced from each request's EmbeddingSource
    (None when no entry's chunk holds a placeholder: the model then embeds ``input_ids`` itself)."""
    if all(e.request.embeds is None for e in entries):
        return None
    ids = input_ids.clone()
    splices: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for e in entries:
        req = e.request
        prompt_end = min(e.end, req.num_prompt_tokens)
        if req.embeds is not None and e.start < prompt_end:
            mask, rows = req.embeds.rows(e.start, prompt_end)
            mask = mask.to(torch.bool).cpu()
            if mask.shape[0] != prompt_end - e.start:
                raise ValueError(f"embedding source of {req.request_id} returned a mask of "
                                 f"{mask.shape[0]} for {prompt_end - e.start} positions")
            if rows.shape[0] == 0 and not bool(mask.any()):  # no placeholder in the chunk (text after the media)
                offset += e.num_new_tokens
                continue
            if rows.shape[0] == mask.shape[0]:
                rows = rows[mask.to(rows.device)]
            at = torch.nonzero(mask)[:, 0] + offset
            ids[at.to(ids.device)] = 0  # placeholder ids may lie outside the vocabulary
            splices.append((at, rows))
        offset += e.num_new_tokens
    if not splices:  # every chunk is text: the model embeds the ids itself, as without a source
        return None
    x = embed(ids).clone()
    for at, rows in splices:
        x[at.to(x.device)] = rows.to(device=x.device, dtype=x.dtype)
    return x
