"""The decode-only slot computation (``decode_slots``, plain Python) gives the tensors of the general
per-token path (``chunk_slots``) on random page tables, released SWA pages included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.engine.batch_builder import _table, chunk_slots, decode_slots
from llm_core.engine.request import Request
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.scheduler import ScheduledRequest


@st.composite
def decode_entries(draw):
    page = draw(st.integers(1, 16))
    entries = []
    for i in range(draw(st.integers(1, 12))):
        start = draw(st.integers(0, 200))
        pages = start // page + 1 + draw(st.integers(0, 2))  # a request may hold pages past its token
        req = Request(f"r{i}", list(range(start + 1)), SamplingParams(max_tokens=4), i)
        req.full_pages = draw(st.lists(st.integers(0, 10_000), min_size=pages, max_size=pages))
        released = draw(st.integers(0, pages))  # behind the window, or no SWA pool at all: -1
        req.swa_pages = [-1] * released + draw(st.lists(st.integers(0, 10_000), min_size=pages - released,
                                                        max_size=pages - released))
        entries.append(ScheduledRequest(req, start, 1))
    return entries, page


@settings(max_examples=80, deadline=None)
@given(decode_entries())
def test_decode_slots_equal_the_general_path(case):
    entries, page = case
    width = max(len(e.request.full_pages) for e in entries)
    full = _table([e.request.full_pages for e in entries], width)
    swa = _table([e.request.swa_pages for e in entries], width)
    fast = decode_slots(entries, page)
    ref = chunk_slots(entries, [1] * len(entries), full, swa, page)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == torch.long
        assert torch.equal(a, b)
