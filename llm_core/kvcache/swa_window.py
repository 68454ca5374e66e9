"""Window arithmetic of the SWA prefix cache: which pages must hold SWA KV, and which the cache keeps.

One definition shared by the radix tree, its lock table and eviction, the tiers and the naive
reference cache, so they cannot disagree (docs/kv_cache.md §3 draws the window-safe match).

``window`` counts the keys a query sees including itself (transformers semantics): the query at
position P sees keys P-W+1 .. P. ``None`` means the model has no sliding layers.
"""

from __future__ import annotations

import bisect
from typing import Sequence


def window_first_page(num_pages: int, window: int | None, page_size: int) -> int:
    """First page whose SWA KV must be present to resume computing at token ``P = num_pages*page_size``.

    The query at P sees keys P-W+1 .. P; keys before P come from the cache:

        W = 4, page_size 2, P = 8:  needs keys 5, 6, 7
        pages   [0 1][2 3][4 5][6 7] | 8
                            ^^^ page 2 = (8 - 4 + 1) // 2

    The last page (num_pages - 1) is always included, even when W - 1 keys fit in less than a page or
    W == 1, so the tail of a match always has SWA KV (which keeps the "leaf is never a tombstone"
    invariant reachable when page_size > window). Without sliding layers nothing is needed.
    """
    if window is None or num_pages == 0:
        return num_pages
    return min(max(0, num_pages * page_size - window + 1) // page_size, num_pages - 1)


def window_safe_pages(swa_valid: Sequence[bool], limit: int, window: int | None, page_size: int) -> int:
    """Largest p <= limit such that pages [window_first_page(p), p) all have valid SWA (0 if none)."""
    if window is None:
        return limit
    last_invalid = -1  # last page index < p whose SWA is missing
    best = 0
    for p in range(1, limit + 1):
        if not swa_valid[p - 1]:
            last_invalid = p - 1
        if last_invalid < window_first_page(p, window, page_size):
            best = p
    return best


def kept_window_ends(prompt_tokens: int, checkpoints: Sequence[int], page_size: int) -> tuple[int, ...]:
    """Sorted page counts p at which a request's windows are kept (pages window_first_page(p) .. p-1):
    the prompt's last whole page, so the same prompt sent again hits up to it, and the page of each
    checkpoint position the caller named (a media region's or a chat message's end), so a prompt
    that shares the text up to there hits up to its last whole page (docs/kv_cache.md §7).

        page_size 4, prompt of 23 tokens, checkpoints at 9 and 17:  pages 2, 4 and 5
    """
    ends = {(prompt_tokens - 1) // page_size} | {c // page_size for c in checkpoints}
    return tuple(sorted(p for p in ends if p > 0))


def keeps_swa(page: int, kept_ends: Sequence[int], every: int, window: int | None, page_size: int) -> bool:
    """Does the tree keep page ``page``'s SWA KV once its request has moved past it?

    Yes inside the window ending at one of ``kept_ends`` (``kept_window_ends``) and inside the
    periodic checkpoint windows (every ``every`` tokens). ``window_first_page`` never decreases as
    the end grows, so of the ends after ``page`` the first one has the widest reach back:

        W = 4, page_size 2, kept ends 3 and 6:  end 3 keeps pages 1, 2;  end 6 keeps pages 4, 5
        page 2 -> first end after it is 3, window_first_page(3) = 1 <= 2 -> kept
    """
    i = bisect.bisect_right(kept_ends, page)
    if i < len(kept_ends) and window_first_page(kept_ends[i], window, page_size) <= page:
        return True
    return is_checkpoint_page(page, every, window, page_size)


def is_checkpoint_page(page: int, every: int, window: int | None, page_size: int) -> bool:
    """True when ``page`` lies in the window kept for a checkpoint (positions every K tokens).

    The checkpoint that can need page j is the first multiple C of K at or after j's end:

        K = 8, page_size 2, W = 4:  C = 8 keeps pages window_first_page(4) .. 3 = 2, 3
        pages [0 1][2 3][4 5][6 7] | [8 9] ...
                          ^^^^^^^^ kept
    """
    if every <= 0 or window is None:
        return False
    c = -(-((page + 1) * page_size) // every) * every
    return window_first_page(c // page_size, window, page_size) <= page
