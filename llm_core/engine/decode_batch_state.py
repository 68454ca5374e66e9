"""The plain path's persistent decode batch: last step's ForwardBatch advanced by one token in place
of a rebuild, when the step's requests are exactly last step's.

A decode step of the same requests in the same order, each one token further, on the same pages,
differs from the previous step only by +1 in positions, sequence lengths and slots (every row's
new token lands in the page its previous token did) -- so those are three adds on last step's
tensors, and the page tables, query_start_loc and logits_indices are last step's tensors as they
are (a ForwardBatch never writes its tensors in place; sharing them between steps is safe).

    last step:  positions [41 17 88]   full slots [9*16+9 ...]   tables T
    this step:  positions [42 18 89]   full slots [9*16+10 ...]  tables T (same tensors)

A row whose token starts a page, or whose page lists changed (a page appended, SWA pages released
behind the window: ``swa_released_pages`` moved), is rewritten alone: its slots and both table rows
from its page lists, into copies of the tables (last step's batch keeps its own).

Anything else is a rebuild (``build_forward_batch``), which becomes the new base:
  - membership or order changed (a request joined, finished, was aborted or preempted), or the
    previous call was not the previous engine step (a mixed step, a probe of one entry);
  - a row lost pages or outgrew the tables' width (the tables' shape changes).
"""

from __future__ import annotations

import torch

from llm_core.engine.batch_builder import page_table, build_forward_batch, slot_values
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.forward_batch import ForwardBatch


# What must not change for a row to be advanced instead of rebuilt (a tuple: compared 32 times a step):
# (request, full_pages length, last Full page, SWA pages released); its token start is the base's + age.
_RowKey = tuple


class DecodeBatchState:
    """Builds each step's (ForwardBatch, input_ids); advances last step's batch when it can."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._batch: ForwardBatch | None = None
        self._rows: list[_RowKey] = []
        self._starts: list[int] = []  # each row's token start in the rebuilt base
        self._step = -2  # the engine step of ``_batch``
        self._age = 0  # steps ``_batch`` is past the rebuilt base
        self._host: list[list[int]] = []
        self.advanced = 0  # steps served by the advance (tests and benchmarks read them)
        self.rebuilt = 0
        self.rows_rewritten = 0  # rows of advanced steps rewritten from their page lists

    def build(self, entries: list[ScheduledRequest], device: torch.device, step: int,
              logits_only: bool = False) -> tuple[ForwardBatch, torch.Tensor]:
        """The ForwardBatch and input ids of ``entries`` at engine step ``step`` (equal to
        ``build_forward_batch(entries, ...)``, tensor for tensor)."""
        batch = self._advance(entries, device, step)
        if batch is None:
            batch, ids = build_forward_batch(entries, self.page_size, device, logits_only=logits_only)
            self._rebase(entries, batch, step)
            return batch, ids
        self.advanced += 1
        return batch, torch.tensor([e.request.token_ids[e.start] for e in entries], dtype=torch.long, device=device)

    # ---- internal helpers -------------------------------------------------------------------
    def _advance(self, entries: list[ScheduledRequest], device: torch.device, step: int) -> ForwardBatch | None:
        """Last step's batch one token on, its changed rows rewritten; None where a rebuild must serve."""
        base, rows, ps = self._batch, self._rows, self.page_size
        if base is None or self._step != step - 1 or len(entries) != len(rows):
            return None
        age = self._age + 1
        changed: list[int] = []
        keys: list[_RowKey] = []
        width = base.full_block_table.shape[1]
        for b, (e, k, start) in enumerate(zip(entries, rows, self._starts)):
            req = e.request
            if req is not k[0] or e.num_new_tokens != 1 or not e.samples or e.start != start + age:
                return None  # membership, order or kind of step changed
            key = (req, len(req.full_pages), req.full_pages[-1] if req.full_pages else -1, req.swa_released_pages)
            if key != k or e.start % ps == 0:
                # pages appended or released, or the token starts a page: rewrite the row; a row that
                # lost pages or outgrew the tables' width changes their shape -> rebuild
                if key[1] < k[1] or key[1] > width:
                    return None
                changed.append(b)
                keys.append(key)
        # Python ints and one torch.tensor each, as the rebuild makes them: numpy's ufuncs measured
        # ~4x slower inside a step than alone (their code is cold after the layers; torch's is not)
        pos, full, swa = self._host
        pos = [p + 1 for p in pos]
        full = [f + 1 for f in full]
        swa = [w + 1 if w >= 0 else w for w in swa]
        full_table, swa_table = base.full_block_table, base.swa_block_table
        if changed:
            for b, f, w in zip(changed, *slot_values([entries[b] for b in changed], ps)[1:]):
                full[b], swa[b] = f, w
            at = torch.tensor(changed, dtype=torch.long, device=device)
            full_table, swa_table = full_table.clone(), swa_table.clone()  # last step's keep their own
            full_table[at] = page_table([entries[b].request.full_pages for b in changed], width).to(device)
            swa_table[at] = page_table([entries[b].request.swa_pages for b in changed], width).to(device)
            for b, key in zip(changed, keys):
                rows[b] = key
            self.rows_rewritten += len(changed)
        self._host = [pos, full, swa]
        self._batch = ForwardBatch(
            positions=torch.tensor(pos, dtype=torch.long, device=device), query_start_loc=base.query_start_loc,
            seq_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long),
            full_slot_mapping=torch.tensor(full, dtype=torch.long, device=device),
            swa_slot_mapping=torch.tensor(swa, dtype=torch.long, device=device), full_block_table=full_table,
            swa_block_table=swa_table, page_size=ps, logits_indices=base.logits_indices,
            # every row of an advanced step samples one token, so a rebuild would give logits_only
            # False and logits_every_row True whatever the caller's flag (build_forward_batch): the
            # base's flags are the rebuild's
            slots_all_valid=base.slots_all_valid, logits_only=base.logits_only,
            logits_every_row=base.logits_every_row)
        self._step, self._age = step, age
        return self._batch

    def _rebase(self, entries: list[ScheduledRequest], batch: ForwardBatch, step: int) -> None:
        """Make a rebuilt batch the base of the next advance (or none: a prompt chunk in the step)."""
        self.rebuilt += 1
        if all(e.num_new_tokens == 1 and e.samples and e.request.full_pages for e in entries):
            self._rows = [(e.request, len(e.request.full_pages), e.request.full_pages[-1],
                           e.request.swa_released_pages) for e in entries]
            self._starts = [e.start for e in entries]
            self._batch, self._step, self._age = batch, step, 0
            # the host values the advance works on (from the entries: no read back from the device)
            self._host = list(slot_values(entries, self.page_size))
        else:
            self._batch, self._rows, self._starts, self._step = None, [], [], -2
