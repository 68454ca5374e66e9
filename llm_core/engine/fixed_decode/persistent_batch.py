"""The persistent decode batch: preallocated input rows of a fixed-shape decode step, updated in place.

As vLLM v1's persistent batch: a request keeps its row from one decode step to the next, and a step
writes only what changed -- its new token, position and length, and the pages added since the last
step -- instead of rebuilding every table. The step then runs over the first B rows, B the smallest
bucket that holds the live requests; rows past the live ones are padding:

    row:          0      1      2      3          bucket B = 4, three live requests
    request:      r7     r2     r9     (pad)
    token/pos:    t/41   t/17   t/88   0/0
    tables:       r7's   r2's   r9's   [scratch, -1, ...]   both pools
    seq_len:      42     18     89     1

A padded row decodes token 0 at position 0 of the engine's scratch page (one page per pool, taken
from the allocators at start-up and never handed to a request), so its K/V write lands there and
never on a real page, and its attention reads only that page.

A row is rewritten whole when its request was not in the previous step (new, or back after a mixed
step, a preemption or a speculative rollback: its page lists may have been replaced or cut), or when
its list is shorter or its last written page differs (a defence: the engine's steps imply a gap); rows of
requests that left are freed and the last live row moves into the hole, so live rows stay 0..n-1.
SWA pages that the scheduler releases behind the window are not mirrored: the step never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llm_core.engine.fixed_decode.step_rows import slot_mappings
from llm_core.engine.scheduled_batch import ScheduledRequest


@dataclass
class _Row:
    request_id: str
    pages: int  # logical pages written into both tables
    step: int  # the runner step that last wrote the row


class PersistentDecodeBatch:
    """Host tables of up to ``max_rows`` decode rows; ``update`` maps a step's entries onto rows."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int, scratch_pages: tuple[int, int]) -> None:
        self.max_rows, self.max_pages, self.page_size = max_rows, max_pages, page_size
        self.scratch_full, self.scratch_swa = scratch_pages
        self.token_ids = np.zeros(max_rows, dtype=np.int64)
        self.positions = np.zeros(max_rows, dtype=np.int64)
        self.seq_lens = np.ones(max_rows, dtype=np.int64)
        self.full_table = np.full((max_rows, max_pages), -1, dtype=np.int64)
        self.swa_table = np.full((max_rows, max_pages), -1, dtype=np.int64)
        self._rows: list[_Row | None] = [None] * max_rows
        self._row_of: dict[str, int] = {}
        for r in range(max_rows):
            self._pad(r)

    # ---- public API -------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._row_of)

    def update(self, entries: list[ScheduledRequest], step: int) -> list[int]:
        """Write this decode step's entries (one new token each) into rows; returns the row of each
        entry. ``step``: the runner's step counter (rows not written at ``step - 1`` are rewritten)."""
        if len(entries) > self.max_rows:
            raise ValueError(f"{len(entries)} decode rows; the persistent batch holds {self.max_rows}")
        live = {e.request.request_id for e in entries}
        for rid in [rid for rid in self._row_of if rid not in live]:
            self._release(rid)
        rows = []
        for e in entries:
            req = e.request
            row = self._row_of.get(req.request_id)
            if row is None:
                row = self._row_of[req.request_id] = len(self._row_of)
                self._rows[row] = _Row(req.request_id, 0, -2)  # never "written last step"
            state = self._rows[row]
            pages = len(req.full_pages)
            if pages > self.max_pages:
                raise ValueError(f"request {req.request_id} holds {pages} pages; "
                                 f"the decode tables hold {self.max_pages}")
            if (state.step != step - 1 or pages < state.pages  # absent last step: lists may be new or cut
                    or (state.pages and self.full_table[row, state.pages - 1] != req.full_pages[state.pages - 1])):
                self.full_table[row] = -1
                self.swa_table[row] = -1
                state.pages = 0
            if pages > state.pages:
                self.full_table[row, state.pages:pages] = req.full_pages[state.pages:pages]
                if req.swa_pages:
                    self.swa_table[row, state.pages:pages] = req.swa_pages[state.pages:pages]
                state.pages = pages
            state.step = step
            self.token_ids[row] = req.token_ids[e.start]
            self.positions[row] = e.start
            self.seq_lens[row] = e.end
            rows.append(row)
        return rows

    def slot_mappings(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """(Full, SWA) slot of each of the first ``bucket`` rows' new token."""
        return slot_mappings(self, bucket)

    def check_integrity(self) -> None:
        """Live rows are 0..n-1 and free rows hold the padding state (tests call it)."""
        n = self.num_live
        if sorted(self._row_of.values()) != list(range(n)):
            raise AssertionError(f"live rows {sorted(self._row_of.values())} are not 0..{n - 1}")
        for r in range(n, self.max_rows):
            if (self._rows[r] is not None or self.token_ids[r] != 0 or self.positions[r] != 0
                    or self.seq_lens[r] != 1 or self.full_table[r, 0] != self.scratch_full
                    or (self.full_table[r, 1:] != -1).any()):
                raise AssertionError(f"free row {r} is not in the padding state")

    # ---- internal helpers -------------------------------------------------------------------
    def _release(self, rid: str) -> None:
        """Free ``rid``'s row; the last live row moves into it so live rows stay 0..n-1."""
        row = self._row_of.pop(rid)
        last = len(self._row_of)  # index of the last live row before the release
        if row != last:
            for a in (self.token_ids, self.positions, self.seq_lens, self.full_table, self.swa_table):
                a[row] = a[last]
            moved = self._rows[last]
            self._rows[row] = moved
            self._row_of[moved.request_id] = row
        self._pad(last)

    def _pad(self, row: int) -> None:
        self._rows[row] = None
        self.token_ids[row] = 0
        self.positions[row] = 0
        self.seq_lens[row] = 1
        self.full_table[row] = -1
        self.swa_table[row] = -1
        self.full_table[row, 0] = self.scratch_full
        self.swa_table[row, 0] = self.scratch_swa
