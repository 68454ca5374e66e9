"""The short-step slot computation (``token_slots``, plain Python) gives the tensors of the general
per-token path (``chunk_slots``) on random page tables and chunk sizes, released SWA pages included;
a step whose chunks hold no placeholder row leaves the embedding to the model."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.engine.batch_builder import (PYTHON_SLOTS_MAX_TOKENS, build_forward_batch, chunk_slots, page_table,
                                          splice_embeds, token_slots)
from llm_core.engine.request import Request
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.scheduled_batch import ScheduledRequest


@st.composite
def decode_entries(draw, max_chunk: int = 1):
    page = draw(st.integers(1, 16))
    entries = []
    for i in range(draw(st.integers(1, 12))):
        start = draw(st.integers(0, 200))
        n = draw(st.integers(1, max_chunk))
        pages = (start + n - 1) // page + 1 + draw(st.integers(0, 2))  # a request may hold pages past its tokens
        req = Request(f"r{i}", list(range(start + n)), SamplingParams(max_tokens=4), i)
        req.full_pages = draw(st.lists(st.integers(0, 10_000), min_size=pages, max_size=pages))
        released = draw(st.integers(0, pages))  # behind the window, or no SWA pool at all: -1
        req.swa_pages = [-1] * released + draw(st.lists(st.integers(0, 10_000), min_size=pages - released,
                                                        max_size=pages - released))
        entries.append(ScheduledRequest(req, start, n))
    return entries, page


@settings(max_examples=80, deadline=None)
@given(st.one_of(decode_entries(), decode_entries(max_chunk=40)))
def test_token_slots_equal_the_general_path(case):
    entries, page = case
    width = max(len(e.request.full_pages) for e in entries)
    full = page_table([e.request.full_pages for e in entries], width)
    swa = page_table([e.request.swa_pages for e in entries], width)
    fast = token_slots(entries, page)
    ref = chunk_slots(entries, [e.num_new_tokens for e in entries], full, swa, page)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == torch.long
        assert torch.equal(a, b)


def test_a_long_step_takes_the_tensor_path_with_the_same_slots():
    req = Request("long", list(range(PYTHON_SLOTS_MAX_TOKENS + 40)), SamplingParams(max_tokens=4), 0)
    req.full_pages = list(range(100, 100 + len(req.token_ids) // 16 + 1))
    req.swa_pages = [-1] * 3 + req.full_pages[3:]
    entries = [ScheduledRequest(req, 0, len(req.token_ids))]
    fb, _ = build_forward_batch(entries, 16, torch.device("cpu"))
    assert torch.equal(fb.full_slot_mapping, token_slots(entries, 16)[1])
    assert torch.equal(fb.swa_slot_mapping, token_slots(entries, 16)[2])


class _Rows:
    """An EmbeddingSource whose placeholders are positions [lo, hi), rows of value 7."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def rows(self, start: int, end: int):
        mask = torch.tensor([self.lo <= p < self.hi for p in range(start, end)])
        return mask, torch.full((int(mask.sum()), 4), 7.0)


@given(st.integers(0, 30), st.integers(1, 10))
def test_splice_leaves_text_only_chunks_to_the_model(start, n):
    """A chunk after (or before) the media: no placeholder row in it, so None (the model embeds the ids,
    which are all text); a chunk holding placeholder rows gets them, the ids' embeddings elsewhere."""
    req = Request("m", list(range(50)), SamplingParams(max_tokens=1), 0)
    req.embeds = _Rows(10, 20)
    entries = [ScheduledRequest(req, start, n)]
    ids = torch.tensor(req.token_ids[start:start + n])
    got = splice_embeds(entries, ids, lambda t: t[:, None].float().expand(-1, 4))
    placeholders = [p for p in range(start, start + n) if 10 <= p < 20]
    if not placeholders:
        assert got is None
        return
    for i, p in enumerate(range(start, start + n)):
        assert torch.equal(got[i], torch.full((4,), 7.0 if p in placeholders else float(p)))


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
