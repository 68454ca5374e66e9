r"""Incremental detokenization: output token ids in, text out, decoding only a short window per step.

    ids   [ ... settled ... | prefix_offset ... read_offset | new ids ]
    text of ids[prefix_offset:]  minus  text of ids[prefix_offset:read_offset]  = the new text

The window restarts after every settled piece, so a multi-byte character split over tokens (its
text ends in U+FFFD until complete) settles once its last byte arrives; until then it is *pending*.
Decoding from ``prefix_offset`` rather than from ``read_offset`` keeps the tokenizer's context
(e.g. SentencePiece's leading-space rule) for the first new token.

One decoder, two users:
- :class:`StopStringMatcher` (engine thread): finds stop strings in the output text, searching only
  the tail a new token can have completed, so a step costs O(1), not O(output length).
- :class:`IncrementalDetokenizer` (event loop): the streamed text deltas; while stop strings are set
  it holds back the last ``max(len(stop)) - 1`` characters (they may begin a stop string, and text
  once sent cannot be taken back). The engine's final text (cut before a matched stop string)
  settles the rest when the request finishes.
"""

from __future__ import annotations

from typing import Any


class IncrementalDecoder:
    """Token ids to text, one window at a time (see module doc)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.pending = ""  # decoded text past the settled part; ends in U+FFFD (an incomplete character)
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; returns the text they settled (complete characters only, maybe "")."""
        self.ids += new_ids
        prefix = self.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.decode(self.ids[self._prefix_offset:])
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        if new and not new.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self.pending = ""
            return new
        self.pending = new
        return ""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class StopStringMatcher:
    """Where the first stop string starts in a request's output text, updated token by token.

    No stop string lay in the text searched before, so one that appears now ends in the new text;
    it starts at most ``max(len(stop)) - 1`` characters before it. Only that tail is searched:

        settled text   [ ........ | tail (max_len - 1) ] + new settled text + pending
                                   \\_____________ searched this step ______________/

    The pending part (a character still incomplete) is searched too, as a full decode would show it.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        if not stops:
            raise ValueError("a StopStringMatcher needs at least one stop string")
        self.stops = stops
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: cut after the stop string
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._keep = max(len(s) for s in stops) - 1
        self._pieces: list[str] = []  # the settled text, joined only when a stop string is found
        self._tail = ""  # the last ``_keep`` settled characters

    def update(self, output_token_ids: list[int], search: bool = True) -> str | None:
        """Take the ids not seen yet; returns the output text cut before the first stop string once
        one appears (after it with ``include_stop``; None until then). ``search`` False: take the text
        without looking for stop strings (min_tokens); a later search still finds one that ends in
        the text it adds."""
        new = self.decoder.push(output_token_ids[len(self.decoder.ids):])
        window = self._tail + new + self.decoder.pending
        hits = [(i, len(s)) for i, s in ((window.find(s), s) for s in self.stops) if i >= 0] if search else []
        if hits:  # once per request: the whole text is joined only here
            settled = "".join(self._pieces)
            text = settled + new + self.decoder.pending
            at, length = min(hits, key=lambda h: (h[0], -h[1]))  # the first; of those starting there, the longest
            return text[:len(settled) - len(self._tail) + at + (length if self.include_stop else 0)]
        if new:
            self._pieces.append(new)
            self._tail = (self._tail + new)[-self._keep:] if self._keep else ""
        return None


class IncrementalDetokenizer:
    """The text deltas of one streamed request (runs on the event loop, never the engine thread)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._sent: list[str] = []  # pieces already sent, joined once at finish
        self._unsent = ""  # settled, held back

    def push(self, new_ids: list[int]) -> str:
        """Text to send for ``new_ids`` (may be empty while characters are incomplete or held back)."""
        if self.tokenizer is None:
            self.decoder.ids += new_ids
            return ""
        self._unsent += self.decoder.push(new_ids)
        return self._emit(len(self._unsent) - self.holdback)

    def finish(self, final_text: str | None) -> str:
        """The rest of the text once the request finished (``final_text``: the engine's, if any)."""
        if self.tokenizer is None:
            return ""
        final = final_text if final_text is not None else self.decoder.decode(self.decoder.ids)
        sent = "".join(self._sent)
        if not final.startswith(sent):
            return ""  # a stop string was cut inside text already sent (cannot happen with holdback)
        self._unsent = final[len(sent):]
        return self._emit(len(self._unsent))

    def _emit(self, upto: int) -> str:
        if upto <= 0:
            return ""
        piece, self._unsent = self._unsent[:upto], self._unsent[upto:]
        self._sent.append(piece)
        return piece
