"""Runs every MTP draft of an engine through two of its proposer's draft paths and requires the same
tokens (tests/llm_core/engine/test_speculative.py, test_fused_draft.py)."""

from __future__ import annotations


def compare_drafts(eng, kept: str, reference: str) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """From now on each draft runs ``proposer.<kept>`` (its tokens go on to the verify step), then
    ``proposer.<reference>`` on the same entries; their tokens must be equal. Returns, per draft,
    (number of requests, each request's k, request 0's drafted tokens)."""
    proposer = eng.speculative.proposer
    first, second, seen = getattr(proposer, kept), getattr(proposer, reference), []

    def draft(entries, kv):
        if not entries:
            return
        lengths = [len(e.request.token_ids) for e in entries]
        second(entries, kv)
        want = [e.request.token_ids[n:] for e, n in zip(entries, lengths)]
        for e, n in zip(entries, lengths):
            del e.request.token_ids[n:]
        first(entries, kv)
        got = [e.request.token_ids[n:] for e, n in zip(entries, lengths)]
        assert got == want, f"{kept} drafted {got}, {reference} {want} at positions {[e.start for e in entries]}"
        seen.append((len(entries), tuple(e.num_draft_tokens for e in entries), got[0]))

    proposer.draft = draft
    return seen
