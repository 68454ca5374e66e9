"""The model's thinking apart from its answer: ``<think>...</think>`` -> ``reasoning_content``, the
rest -> ``content`` (vLLM's and SGLang's ``--reasoning-parser qwen3``, which SGLang serves
MiMo-V2-Flash with).

    ReasoningParser.feed(delta text) -> ReasoningSplit(reasoning, content)     a streamed answer
    ReasoningParser.finish()         -> what it held back, released at the end
    split_reasoning(text)            -> the same parser fed the whole text once (a non-streamed answer)

One implementation for both, so a streamed answer concatenates to the non-streamed one however the
text was cut into deltas (tests/mm_pipeline/prompt/test_reasoning.py checks it with hypothesis).

What the parser decides (qwen3 semantics, where they can be streamed):

    output                                   reasoning                 content
    "<think>R</think>\\n\\nA"                R                         A   (whitespace after the end tag dropped)
    "\\n <think>R</think>A"                  R                         A   (whitespace before <think> dropped)
    "A" (no tags; a non-reasoning answer)    --                        A   (Qwen3: all content)
    "<think>R" (cut by max_tokens / stop)    R                         --  (thinking cut short stays thinking)
    "R</think>A", prompt opened <think>      R                         A   (in_reasoning=True)
    "R</think>A", prompt did not             --                        R</think>A

* No ``</think>`` at all: an answer that never opened ``<think>`` is all content (Qwen3's rule; vLLM's
  deepseek_r1 parser would make it all reasoning, because R1's template opens ``<think>`` itself).
  One that opened it and was cut before ``</think>`` is reasoning: its thinking was streamed as
  reasoning and cannot be taken back. Current vLLM qwen3 and SGLang decide the same; older vLLM
  called it content when not streamed and reasoning when streamed.
* ``<think>`` missing but ``</think>`` present: the start tag was in the prompt (a template that
  opens ``<think>`` in its generation prompt), and text before ``</think>`` is reasoning. Whether it
  was cannot be told from the output until ``</think>`` arrives -- possibly thousands of tokens
  later, or never -- so it is told from the prompt instead (:meth:`ThinkSyntax.prompt_opens_thinking`,
  as vLLM's ``is_reasoning_end`` on the prompt ids) and given as ``in_reasoning``.
* ``<think>`` only counts at the start of the output (after whitespace): later, and after
  ``</think>``, the tags are text the answer talks about, kept verbatim.
* Whitespace after ``</think>`` is dropped: models write ``</think>\\n\\n`` before the answer, which
  is not part of it (SGLang strips it; the MiMo and Qwen3 templates drop it when they render a past
  turn). vLLM's qwen3 parser keeps it; its reasoning text, like ours, is kept verbatim.

Held back while streaming, so a tag is never sent as text: at the start, leading whitespace and a
prefix of ``<think>``; while thinking, a suffix that may begin ``</think>`` (at most 7 characters).
``finish`` releases them: an incomplete tag at the end is text after all.
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from llm_core.engine.structured.params import ReasoningGate

ReasoningParserName = Literal["auto", "qwen3", "none"]
REASONING_PARSERS: tuple[str, ...] = typing.get_args(ReasoningParserName)


@dataclass(frozen=True)
class ReasoningSplit:
    """A piece of generated text as thinking and answer ("" where it holds none)."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "ReasoningSplit") -> "ReasoningSplit":
        return ReasoningSplit(self.reasoning + other.reasoning, self.content + other.content)


class _Phase(enum.Enum):
    OPENING = "opening"  # at the start: whitespace and maybe <think> still to come
    THINKING = "thinking"  # inside <think>: everything until </think> is reasoning
    CLOSING = "closing"  # right after </think>: whitespace there is dropped
    ANSWER = "answer"  # the rest is content, tags included


class ReasoningParser:
    """One answer's text, fed as it arrives (module doc). Not thread-safe: one per choice."""

    def __init__(self, start: str = "<think>", end: str = "</think>", *, in_reasoning: bool = False) -> None:
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.start, self.end = start, end
        self._phase = _Phase.OPENING
        # where the start leads when the output does not open <think> itself
        self._unopened = _Phase.THINKING if in_reasoning else _Phase.ANSWER
        self._held = ""

    @property
    def held(self) -> str:
        """Text fed but not yet given back: whitespace, or a possible tag's beginning."""
        return self._held

    def feed(self, text: str) -> ReasoningSplit:
        """The part of ``text`` (and of what was held) that is decided now."""
        reasoning: list[str] = []
        content: list[str] = []
        buf, self._held = self._held + text, ""
        while buf:
            if self._phase is _Phase.OPENING:
                body = buf.lstrip()
                if body.startswith(self.start):
                    buf, self._phase = body[len(self.start):], _Phase.THINKING
                elif self.start.startswith(body):  # only whitespace, or "<thi": not decided yet
                    self._held, buf = buf, ""
                else:  # no <think> here: the leading whitespace belongs to the text after it
                    self._phase = self._unopened
            elif self._phase is _Phase.THINKING:
                at = buf.find(self.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf, self._phase = buf[at + len(self.end):], _Phase.CLOSING
                else:
                    keep = tag_prefix_at_end(buf, self.end)
                    reasoning.append(buf[:len(buf) - keep])
                    self._held, buf = buf[len(buf) - keep:], ""
            elif self._phase is _Phase.CLOSING:
                buf = buf.lstrip()  # nothing is held: the whitespace is dropped however it arrives
                if buf:
                    self._phase = _Phase.ANSWER
            else:
                content.append(buf)
                buf = ""
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """The end of the output: what was held is text (an unfinished tag is no tag)."""
        held, self._held = self._held, ""
        if self._phase is _Phase.OPENING:
            self._phase = self._unopened
        if not held:
            return ReasoningSplit()
        return ReasoningSplit(reasoning=held) if self._phase is _Phase.THINKING else ReasoningSplit(content=held)

    def parse(self, text: str) -> ReasoningSplit:
        """A whole output: ``feed`` once, then ``finish``."""
        return self.feed(text) + self.finish()


def tag_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (0 if none): what a
    streaming parser holds back because the next text may complete the tag (tool_calls.py too)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_reasoning(text: str, *, in_reasoning: bool = False, start: str = "<think>",
                    end: str = "</think>") -> ReasoningSplit:
    """A whole output as (reasoning, content): the streaming parser fed it once."""
    return ReasoningParser(start, end, in_reasoning=in_reasoning).parse(text)


@dataclass(frozen=True)
class ThinkSyntax:
    """How a reasoning model marks its thinking: the tags, and their ids when they are single tokens
    of its vocabulary (then the prompt tells whether the output starts inside the thinking)."""

    start: str = "<think>"
    end: str = "</think>"
    start_id: int | None = None
    end_id: int | None = None
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def of_tokenizer(cls, tokenizer: Any) -> "ThinkSyntax | None":
        """The tags as the tokenizer has them, or None when it lacks either as a single token (then
        the model was not trained to think in them)."""
        if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
            return None
        vocab = tokenizer.get_vocab()
        start_id, end_id = vocab.get(cls.start), vocab.get(cls.end)
        if start_id is None or end_id is None:
            return None
        special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        return cls(start_id=int(start_id), end_id=int(end_id), special_ids=special)

    @property
    def gate(self) -> ReasoningGate | None:
        """The tags as token ids for the engine (a structured-output grammar holds after the
        thinking, llm_core/engine/structured/params.py), or None when they are not single tokens."""
        if self.start_id is None or self.end_id is None:
            return None
        return ReasoningGate(self.start_id, self.end_id, self.special_ids)

    def prompt_opens_thinking(self, prompt_ids: Sequence[int] | None) -> bool:
        """Whether the prompt ends inside ``<think>``: its generation prompt (the tokens after its
        last special token, ``<|im_start|>`` of the assistant turn) holds a ``<think>`` no
        ``</think>`` follows (``ReasoningGate.prompt_opens``, the engine's rule too). Only that tail
        is read: a user's text spelling ``<think>`` ends before a special token, and a template that
        closes it (``enable_thinking`` off: ``<think></think>``) leaves the model outside."""
        gate = self.gate
        return gate is not None and gate.prompt_opens(prompt_ids)

    def reasoning_tokens(self, output_ids: Sequence[int], text: str, opened: bool = False) -> int:
        """How many of an answer's tokens are its thinking: those strictly between ``<think>`` and
        ``</think>`` (vLLM's count), the tags themselves not; ``text``: the answer's text so far;
        ``opened``: the prompt ended inside ``<think>``. As the parser decides: the answer opens its
        thinking only when its text starts with ``<think>`` after whitespace (anything else first
        and the tag is content), and thinking cut short (no ``</think>``) is thinking to the end. 0
        when the tags are not single tokens (then the thinking cannot be told apart by id)."""
        if self.start_id is None or self.end_id is None:
            return 0
        ids = list(output_ids)
        begin = 0
        if not opened:
            if self.start_id not in ids or not text.lstrip().startswith(self.start):
                return 0
            begin = ids.index(self.start_id) + 1
        end = ids.index(self.end_id, begin) if self.end_id in ids[begin:] else len(ids)
        return end - begin

    def parser(self, opened: bool = False) -> ReasoningParser:
        """A parser for one answer; ``opened``: its prompt ended inside ``<think>``."""
        return ReasoningParser(self.start, self.end, in_reasoning=opened)


def resolve_reasoning(name: str, tokenizer: Any) -> ThinkSyntax | None:
    """``--reasoning-parser`` for a model: the syntax to parse with, or None (off).

    ``auto``: on when the vocabulary has ``<think>`` and ``</think>`` as single tokens (a reasoning
    model, MiMo's), else off -- a model without them never writes them as tags, so its answers are
    left alone. ``qwen3``: on; without those tokens the tags are still found in the text, but the
    prompt can no longer say that the output starts inside ``<think>``. ``none``: off, the text is
    ``content`` verbatim."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
    if name == "none":
        return None
    found = ThinkSyntax.of_tokenizer(tokenizer)
    if name == "auto":
        return found
    return found or ThinkSyntax()


def describe_reasoning(name: str, syntax: ThinkSyntax | None) -> str:
    """One line for the start-up report."""
    if syntax is None:
        why = "auto: no <think> / </think> tokens in the vocabulary" if name == "auto" else "--reasoning-parser none"
        return f"off ({why}); the answer's text is content verbatim"
    why = "auto: <think> and </think> are tokens of the vocabulary" if name == "auto" else "--reasoning-parser qwen3"
    return f"qwen3 ({why}); chat answers put <think>...</think> in reasoning_content"
