"""Incremental detokenization (llm_core.engine.detokenizer): streamed deltas add up to the final text,
stop strings are found exactly where a full decode after every token finds them (across token
boundaries, with multi-byte characters split over tokens), and the work per token does not grow
with the output's length."""

from __future__ import annotations

import random

import pytest

from llm_core.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from samples.checkpoints.tiny_omni import build_tiny_tokenizer, tiny_special_tokens

TEXT = "héllo wörld → ok ✓ "  # 'é', 'ö' (2 bytes), '→', '✓' (3 bytes): one token per byte


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(tiny_special_tokens())  # byte-level BPE without merges


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def full_decode_stop(tok, ids: list[int], stops: tuple[str, ...], include: bool = False) -> tuple[int, str] | None:
    """The reference: decode the whole output after every token, cut at the first stop string
    (after it with ``include``: the longest of those starting there)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        hits = [(i, len(s)) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
        if hits:
            at = min(i for i, _ in hits)
            return k, text[:at + (max(n for i, n in hits if i == at) if include else 0)]
    return None


def matcher_stop(tok, ids: list[int], stops: tuple[str, ...], include: bool = False) -> tuple[int, str] | None:
    m = StopStringMatcher(tok, stops, include_stop=include)
    for k in range(1, len(ids) + 1):
        cut = m.update(ids[:k])
        if cut is not None:
            return k, cut
    return None


# ---- streamed deltas ----------------------------------------------------------------------------
def test_detokenizer_deltas_concatenate_to_the_final_text(tok):
    ids = encode(tok, TEXT)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    assert "".join(pieces) + d.finish(None) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # a split character is sent once complete
    # stop strings: nothing past the stop is ever sent; the engine's cut text settles the end
    d = IncrementalDetokenizer(tok, stop=("wör",))
    sent = "".join(d.push([i]) for i in ids[:len(encode(tok, "héllo wö"))])
    assert "wö" not in sent and TEXT.startswith(sent)
    assert sent + d.finish("héllo ") == "héllo "


def test_detokenizer_without_tokenizer_sends_no_text():
    d = IncrementalDetokenizer(None)
    assert d.push([1, 2]) == "" and d.finish(None) == ""


# ---- stop strings -------------------------------------------------------------------------------
@pytest.mark.parametrize("stops", [
    ("wörld",),  # spans tokens, with a 2-byte character split over two of them
    ("→",),  # one character of three tokens
    ("ö",), ("o w",), ("k ✓",),
    ("zzz", "✓ h"),  # the first stop never appears; the second only across the text's repeat
    ("ld", "hé"),  # two stops: the earlier one in the text wins
])
def test_stop_strings_found_where_a_full_decode_finds_them(tok, stops):
    ids = encode(tok, TEXT * 3)
    want = full_decode_stop(tok, ids, stops)
    assert want is not None
    assert matcher_stop(tok, ids, stops) == want
    kept = matcher_stop(tok, ids, stops, include=True)  # include_stop_str_in_output
    assert kept == full_decode_stop(tok, ids, stops, include=True) and kept[0] == want[0]
    assert kept[1].startswith(want[1]) and kept[1][len(want[1]):] in stops


def test_stop_strings_match_the_full_decode_on_random_byte_soup(tok):
    """Random token ids, broken UTF-8 included: same stopping token and same cut text."""
    rng = random.Random(0)
    alphabet = encode(tok, TEXT)
    for trial in range(40):
        ids = [rng.choice(alphabet) for _ in range(60)]
        text = tok.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(text) - 3)
        stops = (text[start:start + rng.randint(1, 3)], "never")
        assert matcher_stop(tok, ids, stops) == full_decode_stop(tok, ids, stops), (trial, stops)
        assert matcher_stop(tok, ids, stops, True) == full_decode_stop(tok, ids, stops, True), (trial, stops)


def test_a_stop_completed_inside_a_token_is_found_at_that_token():
    """A token whose text completes the stop and also starts an unfinished character: the full
    decode sees the stop at once, so must the matcher (the unfinished character is pending)."""
    tok = ByteTokenizer({0: "a".encode(), 1: "b".encode() + "é".encode()[:1], 2: "é".encode()[1:]})
    assert matcher_stop(tok, [0, 1, 2], ("ab",)) == (2, "")  # text "ab\ufffd" after token 2
    assert matcher_stop(tok, [0, 0, 1, 2], ("ab",)) == (3, "a")


class ByteTokenizer:
    """Token t -> a fixed byte string; text = those bytes decoded with replacement characters."""

    def __init__(self, table: dict[int, bytes]) -> None:
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")


class CountingTokenizer:
    """Records the number of ids and of characters of every decode call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []

    def decode(self, ids, skip_special_tokens=True):
        text = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        self.calls.append((len(ids), len(text)))
        return text


def test_work_per_token_does_not_grow_with_the_output(tok):
    ids = encode(tok, TEXT * 150 + "STOP")  # ~3.5k tokens
    counting = CountingTokenizer(tok)
    m = StopStringMatcher(counting, ("STOP", "never"))
    per_token: list[list[tuple[int, int]]] = []
    cut = None
    for k in range(1, len(ids) + 1):
        before = len(counting.calls)
        cut = m.update(ids[:k])
        per_token.append(counting.calls[before:])
        if cut is not None:
            break
    assert cut == TEXT * 150 and k == len(ids)
    assert all(1 <= len(calls) <= 2 for calls in per_token)  # two short decodes per token, whatever k
    assert max(n for calls in per_token for n, _ in calls) <= 6  # ids: one char behind + one char
    assert max(c for calls in per_token for _, c in calls) <= 2  # characters decoded per call
    # the streaming side is just as bounded
    counting.calls.clear()
    d = IncrementalDetokenizer(counting, stop=("STOP",))
    for i in ids:
        d.push([i])
    assert max(n for n, _ in counting.calls) <= 6 and len(counting.calls) <= 2 * len(ids)


def test_matcher_needs_a_stop_string(tok):
    with pytest.raises(ValueError, match="at least one"):
        StopStringMatcher(tok, ())
