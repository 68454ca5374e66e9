"""The rows of a fixed-shape decode step other than the persistent batch's (persistent_batch.py),
and the one rule both use for a row's KV slots: ``VerifyRows`` (an MTP verify step, each new token a
row of its own) and ``StepRows`` (a step's rows as rank 0 sends them to a tensor-parallel group)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llm_core.engine.scheduled_batch import ScheduledRequest


def slot_mappings(rows, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """(Full, SWA) slot of the new token of each of the first ``bucket`` rows of ``rows`` (a
    PersistentDecodeBatch or VerifyRows: positions, page tables, page_size)."""
    pos = rows.positions[:bucket]
    r = np.arange(bucket)
    page, offset = pos // rows.page_size, pos % rows.page_size
    full = rows.full_table[r, page] * rows.page_size + offset
    swa_page = rows.swa_table[r, page]
    swa = np.where(swa_page >= 0, swa_page * rows.page_size + offset, -1)
    return full, swa


@dataclass(frozen=True)
class StepRows:
    """The first ``bucket`` rows of a fixed-shape step's inputs (a PersistentDecodeBatch's or a
    VerifyRows'), as rank 0 sends them to the other ranks of a tensor-parallel group: the page
    tables cut to the columns in use (a row's Full pages have no holes), padded back to the tables'
    width on arrival so every rank's inputs have its graphs' shapes."""

    token_ids: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    full_table: np.ndarray
    swa_table: np.ndarray
    page_size: int

    @classmethod
    def of(cls, rows, bucket: int) -> "StepRows":
        width = max(1, int((rows.full_table[:bucket] >= 0).sum(axis=1).max()))
        return cls(rows.token_ids[:bucket].copy(), rows.positions[:bucket].copy(), rows.seq_lens[:bucket].copy(),
                   rows.full_table[:bucket, :width].copy(), rows.swa_table[:bucket, :width].copy(), rows.page_size)

    def widened(self, max_pages: int) -> "StepRows":
        """The same rows with tables ``max_pages`` wide (-1 past the columns sent)."""
        full, swa = (np.full((len(self.token_ids), max_pages), -1, dtype=np.int64) for _ in range(2))
        full[:, :self.full_table.shape[1]] = self.full_table
        swa[:, :self.swa_table.shape[1]] = self.swa_table
        return StepRows(self.token_ids, self.positions, self.seq_lens, full, swa, self.page_size)


class VerifyRows:
    """The rows of one step whose entries compute several new tokens each (MTP verify: 1 + k) as a
    fixed-shape decode step: every new token is a row of its own -- its token, its position, its
    request's page tables, and a length that ends at itself -- so the decode attention gives each
    row the causal prefix a prefill of those tokens would (the step writes every row's K/V before any
    row attends). Rows are in entry order (the ragged layout's order), padding rows after them as in
    the persistent batch. One set of host tables, refilled each such step (only the rows and pages the
    last fill wrote are reset); the persistent batch keeps one row per request and is left alone (a
    verify step's requests are rewritten there at their next plain step)."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int, scratch_pages: tuple[int, int]) -> None:
        self.max_pages, self.page_size, self.scratch = max_pages, page_size, scratch_pages
        self.token_ids = np.zeros(max_rows, dtype=np.int64)
        self.positions = np.zeros(max_rows, dtype=np.int64)
        self.seq_lens = np.ones(max_rows, dtype=np.int64)
        self.full_table = np.full((max_rows, max_pages), -1, dtype=np.int64)
        self.swa_table = np.full((max_rows, max_pages), -1, dtype=np.int64)
        self.full_table[:, 0], self.swa_table[:, 0] = scratch_pages
        self.num_rows = 0
        self._dirty_pages = 0  # table columns the last fill wrote

    def fill(self, entries: list[ScheduledRequest]) -> int:
        """Write ``entries``' new tokens as rows 0..R-1 (every other row padding); returns R."""
        n, pages = self.num_rows, self._dirty_pages
        if n:  # back to padding: token 0 at position 0 of the scratch page
            self.token_ids[:n], self.positions[:n], self.seq_lens[:n] = 0, 0, 1
            self.full_table[:n, :pages], self.swa_table[:n, :pages] = -1, -1
            self.full_table[:n, 0], self.swa_table[:n, 0] = self.scratch
        r, widest = 0, 0
        for e in entries:
            req, k = e.request, e.num_new_tokens
            held = len(req.full_pages)
            if held > self.max_pages:
                raise ValueError(f"request {req.request_id} holds {held} pages; the decode tables hold {self.max_pages}")
            rows = slice(r, r + k)
            self.token_ids[rows] = req.token_ids[e.start:e.end]
            self.positions[rows] = np.arange(e.start, e.end)
            self.seq_lens[rows] = np.arange(e.start + 1, e.end + 1)
            self.full_table[rows, 0] = -1
            self.full_table[rows, :held] = req.full_pages
            self.swa_table[rows, 0] = -1
            if req.swa_pages:
                self.swa_table[rows, :held] = np.asarray(req.swa_pages, dtype=np.int64)
            r, widest = r + k, max(widest, held)
        self.num_rows, self._dirty_pages = r, max(widest, 1)
        return r
