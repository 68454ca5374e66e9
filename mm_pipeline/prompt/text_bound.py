"""TextBound: a prompt's text refused against the context limit before all of it is tokenized, and
cut to its last tokens without tokenizing the rest (the layout's guard against a huge text)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from mm_pipeline.errors import ContextLengthError


class TextBound:
    """Rejects text that cannot fit a token budget before all of it is tokenized.

    Two steps, both bounded by the budget rather than by the text:

        chars > budget x longest token       -> too long at once (a token covers at most that many
                                                characters), nothing tokenized
        else tokenize pieces of ~64 K chars,  -> stop at the first piece past budget + one token per
        counting as it goes                     piece cut (a cut may split what would be one token)

    so 50 MB of text costs a length check, and a text just over the limit costs about the limit."""

    PIECE_CHARS = 1 << 16

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        # byte-level vocabularies spell one byte per character, so this bounds characters per token
        self.max_token_chars = max((len(t) for t in vocab), default=0) or 64

    def check(self, texts: Sequence[str], max_tokens: int | None, reserved: int = 0) -> None:
        """``ContextLengthError`` when ``texts`` together surely take more than ``max_tokens`` less
        ``reserved`` (tokens the rest of the prompt surely takes: markup, media)."""
        if max_tokens is None:
            return
        budget = max_tokens - reserved
        rest = f" beside the {reserved} tokens its markup and media take at least" if reserved else ""
        chars = sum(len(t) for t in texts)
        if chars > budget * self.max_token_chars:
            raise ContextLengthError(f"the prompt's text is {chars} characters, more than the context limit of "
                                     f"{max_tokens} tokens can hold{rest}")
        if 4 * chars + len(texts) <= budget:
            return  # a character is at most 4 UTF-8 bytes, each at most one token: it surely fits
        counted = cuts = 0
        for text in texts:
            for piece in _pieces(text, self.PIECE_CHARS):
                counted += len(self.tokenizer.encode(piece, add_special_tokens=False))
                cuts += 1
                if counted > budget + cuts:
                    raise ContextLengthError(f"the prompt's text takes over {budget} tokens, more than the context "
                                             f"limit of {max_tokens} leaves{rest} (stopped counting at {counted})")


    def tail(self, text: str, tokens: int) -> str:
        """The end of ``text`` that surely holds ``tokens`` tokens (a token covers at most
        ``max_token_chars`` characters), cut before a space as a pre-tokenizer cuts: a text cut to
        its last tokens (truncate_prompt_tokens) is tokenized this far, however long it is."""
        chars = tokens * self.max_token_chars
        if len(text) <= chars:
            return text
        start = len(text) - chars
        space = text.find(" ", start)
        return text[space if 0 <= space < start + chars // 2 else start:]


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut before a space where there is one."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            space = text.rfind(" ", start + size // 2, end)
            end = space if space > start else end
        yield text[start:end]
        start = end
