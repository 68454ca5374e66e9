r"""Incremental detokenization for streamed outputs (runs on the event loop, never the engine thread).

Each push decodes only a short window of ids, not the whole output (a step costs O(1), not O(n)):

    ids      [ ... already final ... | prefix_offset ... read_offset | new ids ]
    text of ids[prefix_offset:]  minus  text of ids[prefix_offset:read_offset]  = the new text

The window restarts after every emitted piece, so a multi-byte character split over tokens (its
text ends in U+FFFD until complete) is emitted once its last byte arrives. While stop strings are
set, the last ``max(len(stop)) - 1`` characters are held back: they may begin a stop string, and
text once sent cannot be taken back. When the request finishes, the engine's final text (cut before
a matched stop string) settles the rest.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters only)
        self.emitted = 0  # characters of ``text`` already sent
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        """Text to send for ``new_ids`` (may be empty while characters are incomplete or held back)."""
        self.ids += new_ids
        if self.tokenizer is None:
            return ""
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._emit(len(self.text) - self.holdback)

    def finish(self, final_text: str | None) -> str:
        """The rest of the text once the request finished (``final_text``: the engine's, if any)."""
        if self.tokenizer is None:
            return ""
        final = final_text if final_text is not None else self._decode(self.ids)
        sent = self.text[:self.emitted]
        if not final.startswith(sent):
            return ""  # a stop string was cut inside text already sent (cannot happen with holdback)
        self.text, self.emitted = final, len(sent)
        return self._emit(len(final))

    def token_text(self, token_id: int) -> str:
        """One token as text (for top-logprob maps)."""
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted:upto]
        self.emitted = upto
        return piece
