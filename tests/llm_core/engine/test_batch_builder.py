"""The decode-only slot computation (``decode_slots``, plain Python) gives the tensors of the general
per-token path (``chunk_slots``) on random page tables, released SWA pages included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.engine.batch_builder import page_table, build_forward_batch, chunk_slots, decode_slots
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
    full = page_table([e.request.full_pages for e in entries], width)
    swa = page_table([e.request.swa_pages for e in entries], width)
    fast = decode_slots(entries, page)
    ref = chunk_slots(entries, [1] * len(entries), full, swa, page)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == torch.long
        assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(decode_entries(), st.lists(st.integers(1, 5), max_size=3), st.booleans())
def test_logits_hidden_skips_the_gather_only_when_every_row_samples(case, chunks, last_samples):
    """``logits_every_row`` (every flat row samples: they are 0 .. T-1) hands the hidden states over
    as they are -- the same rows as the gather it replaces; a prompt chunk's rows keep the gather."""
    entries, page = case
    for n in chunks:  # prompt chunks of n tokens at the front of a request: only their last row samples
        req = Request(f"c{n}", list(range(40)), SamplingParams(max_tokens=4), 0)
        req.full_pages = req.swa_pages = list(range(40 // page + 1))
        entries.append(ScheduledRequest(req, 40 - n if last_samples else 0, n))
    fb, ids = build_forward_batch(entries, page, torch.device("cpu"))
    hidden = torch.randn(ids.shape[0], 3)
    every = all(e.num_new_tokens == 1 and e.samples for e in entries)
    assert fb.logits_every_row == every == (fb.logits_indices.shape[0] == ids.shape[0])
    got = fb.logits_hidden(hidden)
    assert torch.equal(got, hidden[fb.logits_indices])
    assert (got is hidden) == fb.logits_every_row
