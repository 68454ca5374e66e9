"""Prefix-cache keys: one key per token, one tuple of them per page (docs/kv_cache.md §2).

A token's key is its id, or ``(id, content key)`` inside a media range, so equal placeholder ids
standing for different images never compare equal:

    token ids     [ 7   9  151 151 151  4 ]      media over [2, 5) with content key b"img-a"
    token keys    [ 7   9  (151,a) (151,a) (151,a)  4 ]
    page keys     ( 7, 9) ((151,a), (151,a)) ((151,a), 4)      page_size 2

The radix tree, the naive reference cache and the tiers' hash chain all build keys here, so they
cannot disagree about what "the same prefix" means.

A request's ``cache_salt`` (vLLM's field: one tenant's secret) is folded into its first token's key
(``salted_extra_keys``), so every page key of the prompt differs from the same prompt's under
another salt or none: requests share cached KV only with requests of the same salt, and a tenant
cannot learn from its time to first token whether another tenant sent a prompt (a prefix-cache
timing attack). Salt ``s`` over a prompt whose first tokens are text:

    extra keys    (media ranges...)         ->  ((0, 1, sha256(salt: s)), media ranges...)
    token keys    [ 7   9  (151,a) ... ]    ->  [ (7,salt) 9 (151,a) ... ]

and when the prompt opens with a media range, that range's content key is rehashed with the salt.
The salt is hashed (32 bytes in every key, whatever its length) and never stored as given.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

PageKey = tuple  # page_size per-token keys: an int token id, or (token id, media key) inside media
ExtraKey = tuple[int, int, bytes]  # (start, end, content key) over token positions [start, end)
MAX_CACHE_SALT_CHARS = 1024  # a salt is a secret of a few dozen characters (vLLM suggests 43: 256 bits, base64)


def check_cache_salt(salt: object) -> str | None:
    """Why ``salt`` cannot salt a request's cache keys (None if it can): a non-empty string of at
    most ``MAX_CACHE_SALT_CHARS`` characters, as vLLM requires (None = no salt)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return f"cache_salt must be a non-empty string if given, got {type(salt).__name__} {salt!r:.40}"
    if len(salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}"
    return None


def salted_extra_keys(extra_keys: Sequence[ExtraKey], salt: str, num_tokens: int) -> tuple[ExtraKey, ...]:
    """``extra_keys`` (checked: sorted, non-overlapping) with ``salt`` folded into the key of the
    prompt's first token (module doc). A prompt of ``num_tokens`` >= 1 tokens."""
    digest = hashlib.sha256(b"mmserve cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    keys = [tuple(k) for k in extra_keys]
    if keys and keys[0][0] == 0:  # the prompt opens with media: rehash its content key with the salt
        lo, hi, key = keys[0]
        keys[0] = (lo, hi, hashlib.sha256(digest + bytes(key)).digest())
    elif num_tokens > 0:
        keys.insert(0, (0, 1, digest))
    return tuple(keys)


def check_extra_keys(extra_keys: Sequence[ExtraKey], num_tokens: int) -> None:
    """Raise ValueError unless the ranges are well formed, sorted and non-overlapping."""
    prev_end = 0
    for item in extra_keys:
        if len(item) != 3:
            raise ValueError(f"extra key must be (start, end, bytes), got {item!r:.80}")
        start, end, key = item
        if not isinstance(key, (bytes, bytearray)) or not key:
            raise ValueError(f"extra key over [{start}, {end}) must be non-empty bytes, got {type(key).__name__}")
        if not (prev_end <= start < end <= num_tokens):
            raise ValueError(f"extra key range [{start}, {end}) must be sorted, non-overlapping and inside "
                             f"the {num_tokens}-token prompt")
        prev_end = end


def token_keys(token_ids: Sequence[int], extra_keys: Sequence[ExtraKey], start: int, end: int) -> list:
    """Keys of positions [start, end): the token id, or (id, content key) inside an extra-key range."""
    keys: list = list(token_ids[start:end])
    for lo, hi, key in extra_keys:
        key = bytes(key)
        # one tuple per distinct id of the range (a media item is mostly one placeholder id), not
        # one per token: the ~1,200 fresh tuples of a 12 s 720p video's match set off a GC pass on
        # the same-prefix request path (0.2-0.9 ms, measured); equal keys either way
        pairs: dict[int, tuple[int, bytes]] = {}
        for pos in range(max(lo, start) - start, min(hi, end) - start):
            tid = keys[pos]
            pair = pairs.get(tid)
            if pair is None:
                pair = pairs[tid] = (tid, key)
            keys[pos] = pair
    return keys


def page_keys(token_ids: Sequence[int], extra_keys: Sequence[ExtraKey], page_size: int,
              first_page: int, end_page: int) -> list[PageKey]:
    """Keys of whole pages [first_page, end_page) (the caller guarantees those pages are complete)."""
    keys = token_keys(token_ids, extra_keys, first_page * page_size, end_page * page_size)
    return [tuple(keys[i:i + page_size]) for i in range(0, len(keys), page_size)]
