"""Prefix-cache keys (llm_core.kvcache.page_keys): a token's key is its id, or (id, content key)
inside a media range, whatever window of positions is asked for; pages are consecutive runs; a
cache_salt changes the first token's key, the same way for the same salt."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.kvcache.page_keys import (MAX_CACHE_SALT_CHARS, check_cache_salt, check_extra_keys, page_keys,
                                        salted_extra_keys, token_keys)


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


@settings(max_examples=100, deadline=None)
@given(prompts(), st.text(min_size=1, max_size=50), st.text(min_size=1, max_size=50))
def test_a_salt_changes_the_first_keys_and_one_salt_keys_alike(prompt, salt, other) -> None:
    ids, ranges, _, _ = prompt
    salted = salted_extra_keys(ranges, salt, len(ids))
    check_extra_keys(salted, len(ids))  # still sorted and non-overlapping
    plain, keys = token_keys(ids, ranges, 0, len(ids)), token_keys(ids, salted, 0, len(ids))
    _, first_end, _ = salted[0]  # the salt's own [0, 1), or the opening media range it rehashed
    assert keys[0] != plain[0] and keys[first_end:] == plain[first_end:]
    assert salted_extra_keys(ranges, salt, len(ids)) == salted  # deterministic: same salt, same keys
    if other != salt:
        assert token_keys(ids, salted_extra_keys(ranges, other, len(ids)), 0, 1) != keys[:1]
    assert len(salted[0][2]) == 32  # the salt is hashed: 32 bytes in the keys whatever its length


def test_a_prompt_that_opens_with_media_salts_the_media_key() -> None:
    ranges = [(0, 4, b"img" * 8), (6, 8, b"aud" * 8)]
    salted = salted_extra_keys(ranges, "tenant-a", 10)
    assert [(lo, hi) for lo, hi, _ in salted] == [(0, 4), (6, 8)]
    assert salted[0][2] != ranges[0][2] and salted[1] == ranges[1]


@pytest.mark.parametrize("salt, problem", [(None, None), ("s", None), ("x" * MAX_CACHE_SALT_CHARS, None),
                                           ("", "non-empty string"), (7, "non-empty string"),
                                           ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most")])
def test_check_cache_salt(salt, problem) -> None:
    got = check_cache_salt(salt)
    assert got is None if problem is None else problem in got
