"""Prefix-cache keys (llm_core.kvcache.page_keys): a token's key is its id, or (id, content key)
inside a media range, whatever window of positions is asked for; pages are consecutive runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.kvcache.page_keys import page_keys, token_keys


@st.composite
def prompts(draw):
    n = draw(st.integers(1, 80))
    ids = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))  # few ids: media ranges repeat them
    cuts = sorted(draw(st.sets(st.integers(0, n), max_size=6)))
    ranges, keys = [], [b"a" * 32, b"b" * 32, bytearray(b"c" * 32)]
    for k in range(0, len(cuts) - 1, 2):
        if cuts[k] < cuts[k + 1]:
            ranges.append((cuts[k], cuts[k + 1], draw(st.sampled_from(keys))))
    start = draw(st.integers(0, n))
    end = draw(st.integers(start, n))
    return ids, ranges, start, end


@settings(max_examples=200, deadline=None)
@given(prompts())
def test_token_keys_are_ids_or_id_and_content_key(prompt) -> None:
    ids, ranges, start, end = prompt
    media = {pos: bytes(key) for lo, hi, key in ranges for pos in range(lo, hi)}
    expected = [(ids[p], media[p]) if p in media else ids[p] for p in range(start, end)]
    got = token_keys(ids, ranges, start, end)
    assert got == expected
    assert all(type(k[1]) is bytes for k in got if isinstance(k, tuple))  # hashable, never a bytearray
    hash(tuple(got))


@settings(max_examples=100, deadline=None)
@given(prompts(), st.integers(1, 8))
def test_page_keys_cut_the_token_keys_into_pages(prompt, page_size: int) -> None:
    ids, ranges, _, _ = prompt
    pages = len(ids) // page_size
    whole = token_keys(ids, ranges, 0, pages * page_size)
    assert page_keys(ids, ranges, page_size, 0, pages) == [
        tuple(whole[i:i + page_size]) for i in range(0, pages * page_size, page_size)]
    if pages > 1:  # a window of pages is the same pages
        assert page_keys(ids, ranges, page_size, 1, pages) == page_keys(ids, ranges, page_size, 0, pages)[1:]
