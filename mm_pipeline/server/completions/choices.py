"""One engine stream per answer choice: prefetch the first delta, accumulate, merge, close.

    client request ──► n ChoiceStreams (engine.generate per choice, request ids <id>-0 .. <id>-n-1)
                         │ start(): await every first delta  ← media errors and requests the engine
                         │                                     rejects at once surface here, before
                         │                                     any HTTP status is sent
                         ├─ collect(): drain to the end (non-streamed answer)
                         └─ merge_choices(): (index, delta) in arrival order (streamed answer)
    reasoning (chat only, ``reasoning=ThinkSyntax``): each choice parses its own text -- the answer
             that is not streamed splits the whole text once (answer()), a streamed one delta by
             delta (split(), called by the consumer in the choice's order); both are one parser
             (prompt/reasoning.py), so they agree. The start state comes from the first delta's
             prompt ids: a prompt that opened <think> puts the output inside the thinking.
    tool calls (chat only, ``tool_calls``: a parser factory for the request's tools): the content
             the reasoning split leaves goes through one tool-call parser per choice the same way
             (prompt/tool_calls.py), streamed or not; ``calls_made`` counts a choice's calls (the
             index of its next streamed call; its finish_reason is "tool_calls" once it made any).
    on_tokens(previous, now, count): told each time a choice absorbs tokens (the request's metrics:
             RequestWatch); ``previous`` is when its tokens before these came, None for its first.
    close(): the one place a choice lets go of its engine stream — cancel a first-delta wait still
             running (the generator's ``finally`` runs: admission slot, KV pages and cache locks
             are released), then aclose() the iterator (the same for a suspended one). Called from
             ``finally`` so admission failure part-way, exceptions, cancellation and disconnects all
             take this path; ``aclose()`` alone fails on a generator that is still running.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from mm_pipeline.errors import generation_error
from mm_pipeline.prompt.reasoning import ReasoningParser, ReasoningSplit, ThinkSyntax
from mm_pipeline.server.responses import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from mm_pipeline.prompt.tool_calls import ForcedCallParser, ToolCall, ToolCallParser


# (when the choice's previous tokens came, None for its first; when these came; how many), time.perf_counter()
TokenHook = Callable[[float | None, float, int], None]


@dataclass(frozen=True)
class AnswerPart:
    """A piece of a chat answer: its thinking, its content and the tool calls parsed out of it."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = ()


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    encoder_cache_hits: int = 0  # encoder units taken from the cache (known from the first delta)
    first_token_at: float | None = None  # time.perf_counter() when the first token reached us
    last_token_at: float | None = None  # ... when the latest tokens did
    finished_at: float | None = None  # ... when the finished delta did: this choice's own end (n choices end apart)
    error: str | None = None
    error_kind: str | None = None  # with finish_reason "error": the engine's ErrorKind
    prompt_logprobs: Any = None  # llm_core PromptLogprobs of prompt tokens 1.. (prompt_logprobs asked)
    prompt_token_ids: list[int] | None = None  # the prompt as the engine ran it (from the first delta)

    def absorb(self, delta: Any) -> None:
        if delta.new_token_ids or delta.finished:
            now = time.perf_counter()
            if delta.new_token_ids:
                if self.first_token_at is None:
                    self.first_token_at = now
                self.last_token_at = now
            if delta.finished:
                self.finished_at = now
        self.text += delta.new_text or ""
        self.token_ids += list(delta.new_token_ids or ())
        self.logprobs += list(delta.logprobs or ())
        self.top_logprobs += list(delta.top_logprobs or ())
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = delta.completion_tokens or len(self.token_ids)
        self.cached_tokens = delta.cached_tokens or self.cached_tokens
        self.encoder_cache_hits = getattr(delta, "encoder_cache_hits", 0) or self.encoder_cache_hits
        self.prompt_logprobs = getattr(delta, "prompt_logprobs", None) or self.prompt_logprobs
        if getattr(delta, "prompt_token_ids", None) is not None:
            self.prompt_token_ids = list(delta.prompt_token_ids)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.error, self.error_kind = delta.error, delta.error_kind


class ChoiceStream:
    """One engine generation seen as an async iterator with a prefetched first delta."""

    def __init__(self, index: int, stream: AsyncIterator[Any], reasoning: ThinkSyntax | None = None,
                 tool_calls: Callable[[], ToolCallParser | ForcedCallParser] | None = None,
                 max_calls: int | None = None, on_tokens: TokenHook | None = None) -> None:
        self.index = index
        self.on_tokens = on_tokens
        self.state = ChoiceState()
        self._stream = stream
        self._first: Any | None = None
        self._done = False
        self._starting: asyncio.Task | None = None  # the first-delta wait, owned so close() can end it
        self._reasoning = reasoning
        self._opened = False  # the prompt ends inside <think> (told by the first delta's prompt ids)
        self._parser: ReasoningParser | None = None  # split()'s, made on its first call
        self._tool_calls = tool_calls
        self._tool_parser: ToolCallParser | ForcedCallParser | None = None  # split()'s, made on its first call
        self.calls_made = 0
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (the calls after the first are dropped)

    async def start(self) -> None:
        """Wait for the first delta (raises what the engine raises for bad input)."""
        self._starting = asyncio.ensure_future(self._first_delta())
        try:
            self._first = await self._starting
        except StopAsyncIteration:
            self._done = True
            return
        # known before the response starts, so it can go into a response header
        self.state.encoder_cache_hits = getattr(self._first, "encoder_cache_hits", 0)
        if self._reasoning is not None:
            self._opened = self._reasoning.prompt_opens_thinking(getattr(self._first, "prompt_token_ids", None))
        if self._first.finished:  # rejected by the engine before any token: a status, not a stream event
            error = generation_error(self._first.finish_reason, self._first.error_kind, self._first.error)
            if error is not None:
                raise error

    async def deltas(self) -> AsyncIterator[Any]:
        if self._first is not None:
            first, self._first = self._first, None
            self._absorb(first)
            yield first
            if first.finished:
                self._done = True
        while not self._done:
            try:
                delta = await self._stream.__anext__()
            except StopAsyncIteration:
                self._done = True
                return
            self._absorb(delta)
            yield delta
            if delta.finished:
                self._done = True

    async def collect(self) -> ChoiceState:
        async for _ in self.deltas():
            pass
        return self.state

    def answer(self) -> AnswerPart:
        """The text so far as (reasoning, content, calls): a non-streamed answer, once collected."""
        if self._reasoning is None:
            split = ReasoningSplit(content=self.state.text)
        else:
            split = self._reasoning.parser(self._opened).parse(self.state.text)
        if self._tool_calls is None:
            return AnswerPart(split.reasoning, split.content)
        found = self._tool_calls().parse(split.content)
        calls = found.calls if self.max_calls is None else found.calls[:self.max_calls]
        self.calls_made = len(calls)
        return AnswerPart(split.reasoning, found.content, calls)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, known from the first delta (before it is taken from the stream too)."""
        return self.state.prompt_tokens or getattr(self._first, "prompt_tokens", 0) or 0

    def reasoning_tokens(self) -> int:
        """How many of the tokens so far are thinking (0 without a reasoning parser)."""
        if self._reasoning is None:
            return 0
        return self._reasoning.reasoning_tokens(self.state.token_ids, self.state.text, self._opened)

    def split(self, delta: Any) -> AnswerPart:
        """``delta``'s text as (reasoning, content, calls), for a streamed answer: call it once for
        each delta of this choice, in their order (the parsers keep state across them); the finished
        delta also releases what was held back (a possible tag's beginning, an unclosed call). The
        engine ends every stream with a finished delta, so nothing stays held."""
        text = delta.new_text or ""
        if self._reasoning is None:
            part = ReasoningSplit(content=text)
        else:
            if self._parser is None:
                self._parser = self._reasoning.parser(self._opened)
            part = self._parser.feed(text)
            if delta.finished:
                part += self._parser.finish()
        if self._tool_calls is None:
            return AnswerPart(part.reasoning, part.content)
        if self._tool_parser is None:
            self._tool_parser = self._tool_calls()
        found = self._tool_parser.feed(part.content)
        if delta.finished:
            found += self._tool_parser.finish()
        calls = found.calls if self.max_calls is None else found.calls[:max(0, self.max_calls - self.calls_made)]
        self.calls_made += len(calls)
        return AnswerPart(part.reasoning, found.content, calls)

    async def close(self) -> None:
        """Release the engine stream (idempotent): see the module doc."""
        starting = self._starting
        if starting is not None:
            if not starting.done():
                starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)  # its finally has run when this returns
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    def _absorb(self, delta: Any) -> None:
        previous = self.state.last_token_at
        self.state.absorb(delta)
        if delta.new_token_ids and self.on_tokens is not None:
            self.on_tokens(previous, self.state.last_token_at, len(delta.new_token_ids))

    async def _first_delta(self) -> Any:
        return await self._stream.__anext__()


async def start_all(choices: Sequence[ChoiceStream]) -> None:
    """Prefetch every choice's first delta concurrently; on any failure close them all and raise."""
    try:
        await asyncio.gather(*(c.start() for c in choices))
    except BaseException:
        await close_all(choices)
        raise


async def close_all(choices: Sequence[ChoiceStream]) -> None:
    """Close every choice; an error closing one never keeps the others open."""
    # shield: closing must finish even when the caller is being cancelled (client disconnect)
    await asyncio.shield(asyncio.gather(*(c.close() for c in choices), return_exceptions=True))


async def collect_all(choices: Sequence[ChoiceStream]) -> list[ChoiceState]:
    """Drain every choice (a non-streamed answer). The answer is an error once one choice fails
    (it raises, or ends with an error), so the others stop then -- their tasks are cancelled
    before their streams are closed (``aclose`` fails on a generator a task still iterates) --
    instead of generating to ``max_tokens`` while holding their admission slots and KV."""
    tasks = [asyncio.ensure_future(c.collect()) for c in choices]
    try:
        for done in asyncio.as_completed(tasks):
            if (await done).error is not None:
                break
        return [c.state for c in choices]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.shield(_stop(tasks, choices))  # runs to the end even if we are cancelled now


async def _stop(tasks: Sequence[asyncio.Future], choices: Sequence[ChoiceStream]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    await close_all(choices)


async def merge_choices(choices: Sequence[ChoiceStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) from every choice as they arrive; closes all streams at the end."""
    if len(choices) == 1:  # the common case needs no tasks
        try:
            async for d in choices[0].deltas():
                yield choices[0].index, d
        finally:
            await close_all(choices)
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(c: ChoiceStream) -> None:
        try:
            async for d in c.deltas():
                await queue.put((c.index, d))
        except BaseException as exc:  # re-raised in the consumer
            await queue.put((c.index, exc))
        finally:
            await queue.put((c.index, end))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(choices)


class TokenStrings:
    """Token id -> text for logprob entries (one tokenizer call per distinct id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self._tok is None:
                s = str(token_id)
            else:
                s = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s

    def label(self, token_id: int, as_ids: bool) -> str:
        """A logprob entry's token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self(token_id)

    def chat_logprobs(self, ids: Sequence[int], lps: Sequence[float],
                      tops: Sequence[dict[int, float]], as_ids: bool = False) -> ChatLogprobs:
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            top = tops[i] if i < len(tops) and tops[i] else {}
            s = self.label(tid, as_ids)
            content.append(TokenLogprob(
                token=s, logprob=lp, bytes=list(s.encode("utf-8")),
                top_logprobs=[TopLogprob(token=(ts := self.label(t, as_ids)), logprob=v, bytes=list(ts.encode("utf-8")))
                              for t, v in sorted(top.items(), key=lambda kv: -kv[1])]))
        return ChatLogprobs(content=content)

    def completion_logprobs(self, ids: Sequence[int], lps: Sequence[float | None],
                            tops: Sequence[dict[int, float] | None], offset: int = 0,
                            out: CompletionLogprobs | None = None, as_ids: bool = False) -> CompletionLogprobs:
        """The legacy format's logprobs of ``ids`` (appended to ``out`` when given). A ``None``
        logprob -- an echoed prompt's first token, which has none -- has None for its top too."""
        out = CompletionLogprobs() if out is None else out
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            s = self.label(tid, as_ids)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            top = tops[i] if i < len(tops) and tops[i] else {}
            # the legacy format keys by text: tokens reading alike keep the most likely one's logprob
            by_text: dict[str, float] = {}
            for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
                by_text.setdefault(self.label(t, as_ids), v)
            out.top_logprobs.append(None if lp is None else by_text)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def echoed_prompt_logprobs(self, prompt_ids: Sequence[int] | None, found: Any, n: int,
                               as_ids: bool = False) -> CompletionLogprobs | None:
        """An echoed prompt's logprobs in the legacy format, as vLLM gives them (echo with
        logprobs=n): the first token's entries None, then each token's logprob and top-n. None
        when the engine gave none (the request failed before its first token)."""
        if found is None or prompt_ids is None:
            return None
        return self.completion_logprobs(prompt_ids, (None, *found.logprobs), ({}, *(_top(t, n) for t in found.top)),
                                        as_ids=as_ids)

    def prompt_logprobs(self, prompt_ids: Sequence[int], found: Any,
                        n: int) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs`` answer (``prompt_logprobs=n``): None for the first prompt
        token, then per token {token id: {logprob, rank, decoded_token}} of the token itself and
        the top-n. None when the engine gave none (an engine or replica that does not compute
        them: the answer says null rather than failing)."""
        if found is None:
            return None
        out: list[dict[str, PromptLogprob] | None] = [None]
        for tid, lp, rank, top in zip(prompt_ids[1:], found.logprobs, found.ranks, found.top):
            entry = {str(tid): PromptLogprob(logprob=lp, rank=rank, decoded_token=self(tid))}
            ordered = sorted(top.items(), key=lambda kv: -kv[1])[:n]
            for k, (t, v) in enumerate(ordered):
                entry.setdefault(str(t), PromptLogprob(logprob=v, rank=k + 1, decoded_token=self(t)))
            out.append(entry)
        return out


def _top(top: dict[int, float], n: int) -> dict[int, float]:
    """The ``n`` likeliest of a top map the engine computed for a larger n (the request's fields
    may ask two sizes of one computation)."""
    return top if len(top) <= n else dict(sorted(top.items(), key=lambda kv: -kv[1])[:n])
