"""Turn a ScheduledBatch into the model's ForwardBatch (flat tokens, slot mappings, page tables).

Slot of a token at logical position ``pos`` of request b, in either pool:

    page = table[b, pos // page_size]          (-1 in the SWA table: released)
    slot = page * page_size + pos % page_size

    e.g. page_size 4, full_pages [7, 2]:  pos 5 -> page 2, offset 1 -> slot 9
"""

from __future__ import annotations

import torch

from llm_core.model.forward_batch import ForwardBatch
from llm_core.engine.scheduler import ScheduledRequest


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def build_forward_batch(
    entries: list[ScheduledRequest], page_size: int, device: torch.device
) -> tuple[ForwardBatch, torch.Tensor]:
    """(ForwardBatch, input_ids [T]) for the scheduled entries, in entry order.

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
    full_table = _table([e.request.full_pages for e in entries], width)
    swa_table = _table([e.request.swa_pages for e in entries], width)

    if all(n == 1 for n in counts):  # decode only: one token per request at position start
        positions = torch.tensor([e.start for e in entries], dtype=torch.long)
        row = torch.arange(len(entries))
    else:
        # position of each flat token: its request's start + its offset inside the request's chunk
        positions = torch.cat([torch.arange(e.start, e.end) for e in entries])
        row = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor(counts, dtype=torch.long))
    page_idx, in_page = positions // page_size, positions % page_size
    full_slots = full_table[row, page_idx] * page_size + in_page
    swa_pages = swa_table[row, page_idx]
    swa_slots = torch.where(swa_pages >= 0, swa_pages * page_size + in_page, -1)

    sample_rows = [qsl[b + 1] - 1 for b, e in enumerate(entries) if e.samples]
    batch = ForwardBatch(
        positions=positions.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.long),
        seq_lens=torch.tensor([e.end for e in entries], dtype=torch.long),
        full_slot_mapping=full_slots.to(device),
        swa_slot_mapping=swa_slots.to(device),
        full_block_table=full_table.to(device),
        swa_block_table=swa_table.to(device),
        page_size=page_size,
        logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=device),
    )
    return batch, torch.tensor(ids, dtype=torch.long, device=device)
