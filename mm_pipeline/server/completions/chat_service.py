"""Chat and text completions on top of an engine, independent of HTTP (the server and the batch
runner both use it).

Engine contract used here (``mm_pipeline.runtime.omni_engine.OmniEngine``):
``generate(messages, params, request_id=...)`` / ``generate_prompt(prompt, params, ...)`` return
async iterators of ``GenerationDelta``; bad media, malformed messages and overload raise a typed
``mm_pipeline.errors`` error before the first delta; a request that fails later ends with a delta
carrying its ``error_kind``, which becomes the same typed error here; closing an iterator early
aborts its request.

Each request started is observed once however it ends -- done, failed, aborted, or its client gone
-- by the service's ``Observer`` (the app's metrics and request log): request_watch.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.errors import InvalidInputError, echo, generation_error
from mm_pipeline.server.completions.answer_info import AnswerInfo
from mm_pipeline.server.completions.choices import (AnswerPart, ChoiceState, ChoiceStream, TokenStrings, close_all,
                                        merge_choices)
from mm_pipeline.server.completions.request_watch import Observer, RequestWatch
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.completions.sampling_fields import SamplingFields
from mm_pipeline.server.protocol import ChatCompletionRequest, CompletionRequest
from mm_pipeline.server.completions.request_params import parsed_messages, request_ids, sampling_params
from mm_pipeline.prompt.reasoning import ThinkSyntax
from mm_pipeline.server.completions.token_usage import chat_usage, prompts_usage, running_usage
from mm_pipeline.server.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                          ChatCompletionChunk, Completion, CompletionChoice, Delta)
from mm_pipeline.server.sse import DONE, error_event, sse_event
from mm_pipeline.prompt.tool_calls import ForcedCallParser, ToolCallSyntax

@dataclass(frozen=True)
class ServiceConfig:
    model_name: str
    default_max_tokens: int | None = None  # ServerSettings'; None: the model's max_new_tokens, else 512
    max_completion_prompts: int = 16  # ServerSettings.max_completion_prompts
    # ServerSettings.reasoning_parser resolved for the model (prompt/reasoning.py); None: off.
    # Chat answers only: a text completion is the raw continuation of a prompt, as in vLLM.
    reasoning: ThinkSyntax | None = None
    # ServerSettings.tool_call_parser resolved for the model (prompt/tool_calls.py); None: off, and a
    # chat request with tools is a 400 (nothing would turn the model's calls into tool_calls)
    tool_calls: ToolCallSyntax | None = None
    # ServerSettings.return_tokens_as_token_ids: the default of the request field of that name
    tokens_as_ids: bool = False
    model_aliases: tuple[str, ...] = ()  # ServerSettings': other names a request may give the model
    # the sampling of a request that leaves a field unset, max_new_tokens the max_tokens when
    # default_max_tokens is None; None: the engine's generation_defaults (its checkpoint's generation_config.json)
    defaults: GenerationDefaults | None = None


def _message(answer: AnswerPart) -> AssistantMessage:
    if not answer.calls:
        return AssistantMessage(content=answer.content, reasoning_content=answer.reasoning or None)
    return AssistantMessage(content=answer.content or None, reasoning_content=answer.reasoning or None,
                            tool_calls=[c.as_openai() for c in answer.calls])


def _finish_reason(reason: str | None, calls: int) -> str | None:
    """An answer that made tool calls and ended by itself ends with "tool_calls"; one cut short
    (max_tokens: "length") says so, as OpenAI's does (vLLM says "tool_calls" whatever stopped it):
    its later calls may be missing."""
    return "tool_calls" if calls and reason == "stop" else reason


def _check_finished(states: list[ChoiceState]) -> None:
    """Raise the typed error of the first choice that failed (by its kind, see mm_pipeline/errors.py)."""
    for s in states:
        error = generation_error(s.finish_reason, s.error_kind, s.error)
        if error is not None:
            raise error


class ChatService:
    """OpenAI chat / text completions over an engine."""

    def __init__(self, engine: Any, config: ServiceConfig, observer: Observer | None = None) -> None:
        self.engine = engine
        self.config = config
        self.defaults = config.defaults or getattr(engine, "generation_defaults", None) or GenerationDefaults()
        self.tokens = TokenStrings(getattr(engine, "tokenizer", None))
        self._observer = observer  # the metrics and the request log (request_watch.py)

    # ---- chat -------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, info: AnswerInfo | None = None) -> ChatCompletion:
        arrival = time.perf_counter()
        rid, base = request_ids("chatcmpl", req.request_id)
        watch = RequestWatch(rid, arrival, req.n, self._observer)
        choices = await self._start_chat(req, base, watch, info)
        if info is not None:
            info.request_id = rid
        states = await watch.collect(choices)
        _check_finished(states)
        answers = [c.answer() for c in choices]
        scored = states[0] if states and req.prompt_logprobs is not None else None
        return ChatCompletion(
            id=rid, created=int(time.time()), model=self.config.model_name,
            usage=chat_usage(choices, self.config.reasoning),
            prompt_logprobs=None if scored is None else self.tokens.prompt_logprobs(
                scored.prompt_token_ids or [], scored.prompt_logprobs, req.prompt_logprobs),
            choices=[ChatChoice(index=i, message=_message(a), finish_reason=_finish_reason(s.finish_reason, len(a.calls)),
                                logprobs=self.tokens.chat_logprobs(s.token_ids, s.logprobs, s.top_logprobs,
                                                                   self._as_ids(req))
                                if req.logprobs else None)
                     for i, (a, s) in enumerate(zip(answers, states))])

    async def chat_stream(self, req: ChatCompletionRequest, info: AnswerInfo | None = None,
                          route: str | None = None) -> tuple[AsyncIterator[str], Callable]:
        """Start the request (errors raise here, before any byte is sent; ``info`` is filled) and
        return the SSE event iterator plus an idempotent ``close`` to call when the response ends
        for any reason. ``route``: the path the request came by, for the log line of an error the
        stream carries."""
        # OpenAI's chunk shape, whatever the options: finish_reason and logprobs always (null until
        # set), the role in a choice's first delta only, and "usage" only with include_usage (null
        # in every chunk but the last, which carries it)
        leave_out = None if req.include_usage else {"usage"}
        info = info if info is not None else AnswerInfo()
        chunks, close = await self.chat_chunks(req, info)

        async def events() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    yield sse_event(c.model_dump(exclude=leave_out))
            except Exception as exc:
                yield error_event(exc, route, info.request_id)
            yield DONE

        return events(), close

    async def chat_chunks(self, req: ChatCompletionRequest,
                          info: AnswerInfo | None = None) -> tuple[AsyncIterator[ChatCompletionChunk], Callable]:
        """``chat_stream``'s chunks as objects (the audio API reshapes them): the role first, a
        chunk per delta with text, tool calls, logprobs or an end, and with include_usage a last
        one of usage alone. An error part-way raises from the iterator."""
        arrival = time.perf_counter()
        rid, base = request_ids("chatcmpl", req.request_id)
        watch = RequestWatch(rid, arrival, req.n, self._observer)
        choices = await self._start_chat(req, base, watch, info)
        if info is not None:
            info.request_id = rid
        created, model = int(time.time()), self.config.model_name
        as_ids = self._as_ids(req)

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            usage = running_usage(choices, len(choices)) if req.continuous_usage else None
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice], usage=usage)

        async def chunks() -> AsyncIterator[ChatCompletionChunk]:
            try:
                for c in choices:  # OpenAI sends the role first, once per choice
                    yield chunk(ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")))
                async for index, d in merge_choices(choices):
                    lp = (self.tokens.chat_logprobs(d.new_token_ids or [], d.logprobs or [], d.top_logprobs or [],
                                                    as_ids)
                          if req.logprobs and d.new_token_ids else None)
                    if d.finished:
                        _check_finished([choices[index].state])
                    choice = choices[index]
                    part = choice.split(d)  # every delta, in order: the parsers hold state
                    if part.reasoning or part.content or part.calls or lp is not None or d.finished:
                        delta = Delta.of_text(part.reasoning, part.content)
                        if part.calls:
                            first = choice.calls_made - len(part.calls)
                            delta.tool_calls = [{"index": first + k, **c.as_openai()}
                                                for k, c in enumerate(part.calls)]
                            delta.content = part.content or None
                        reason = _finish_reason(d.finish_reason, choice.calls_made) if d.finished else None
                        yield chunk(ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=reason))
                if req.include_usage:
                    yield ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=chat_usage(choices, self.config.reasoning))
            finally:  # every end: done, an error or abort raised above, the client gone (request_watch.py)
                watch.end(choices)

        async def close() -> None:
            await close_all(choices)
            watch.end(choices)  # a client gone while a chunk was sent: chunks() may never resume

        return chunks(), close

    async def _start_chat(self, req: ChatCompletionRequest, base: str, watch: RequestWatch,
                          info: AnswerInfo | None = None) -> list[ChoiceStream]:
        """The request's choices, started; ``base``: their engine ids' (choice i is ``<base>-<i>``)."""
        self.check_model(req.model)
        self._check_slots(req.n)
        syntax = self.config.tool_calls
        if req.parse_tool_calls and syntax is None:
            raise InvalidInputError("tools need the server's tool-call parser, which is off (start it with "
                                    "--tool-call-parser qwen3_coder, or auto for a model that knows <tool_call>)")
        tools = tuple(req.tools or ())
        if req.forces_tool_calls:  # JSON a grammar forces (the request's constraint), read at the end
            parser = lambda: ForcedCallParser(req.forced_function)  # noqa: E731
        else:
            parser = (lambda: syntax.parser(tools)) if syntax is not None and req.parse_tool_calls else None
        messages = await parsed_messages(req)
        # the first choice alone scores the prompt (prompt_logprobs): the answer carries it once
        choices = [ChoiceStream(i, self.engine.generate(messages, self._sampling(req, req.logprobs_n, i,
                                                                                 reasoning=self.config.reasoning,
                                                                                 scores_prompt=i == 0),
                                                        request_id=f"{base}-{i}", priority=req.priority,
                                                        cache_salt=req.cache_salt),
                                self.config.reasoning, parser, None if req.parallel_tool_calls else 1,
                                on_tokens=watch.tokens)
                   for i in range(req.n)]
        await watch.start(choices)
        if info is not None and choices:
            info.encoder_cache_hits = choices[0].state.encoder_cache_hits
        return choices

    # ---- text completions -------------------------------------------------------------------
    async def complete(self, req: CompletionRequest, info: AnswerInfo | None = None) -> Completion:
        """``info`` is accepted so chat and text completions share one call shape; a text prompt
        has no media, so it stays at zero encoder-cache hits."""
        arrival = time.perf_counter()
        rid, base = request_ids("cmpl", req.request_id)
        watch = RequestWatch(rid, arrival, req.n, self._observer)
        choices, prompts = await self._start_completion(req, base, watch)
        if info is not None:
            info.request_id = rid
        states = await watch.collect(choices)
        _check_finished(states)
        out = []
        for p, prompt in enumerate(prompts):
            group = states[p * req.n:(p + 1) * req.n]
            first = group[0]  # the choice that scored the prompt, for all of them (_start_completion)
            for j, s in enumerate(group):
                echo = self._echo_text(req, prompt, s.prompt_token_ids) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = self.tokens.echoed_prompt_logprobs(first.prompt_token_ids, first.prompt_logprobs, req.logprobs,
                                                            self._as_ids(req)) if req.echo else None
                    offset = len(echo) if lp is None else lp.end_offset
                    lp = self.tokens.completion_logprobs(s.token_ids, s.logprobs, s.top_logprobs, offset=offset, out=lp,
                                                         as_ids=self._as_ids(req))
                out.append(CompletionChoice(
                    index=p * req.n + j, text=echo + s.text, logprobs=lp, finish_reason=s.finish_reason,
                    prompt_logprobs=None if req.prompt_logprobs is None else self.tokens.prompt_logprobs(
                        first.prompt_token_ids or [], first.prompt_logprobs, req.prompt_logprobs)))
        return Completion(id=rid, created=int(time.time()), model=self.config.model_name, choices=out,
                          usage=prompts_usage(states, req.n))

    async def complete_stream(self, req: CompletionRequest, info: AnswerInfo | None = None,
                              route: str | None = None) -> tuple[AsyncIterator[str], Callable]:
        """As ``chat_stream``, for a text completion."""
        arrival = time.perf_counter()
        rid, base = request_ids("cmpl", req.request_id)
        watch = RequestWatch(rid, arrival, req.n, self._observer)
        choices, prompts = await self._start_completion(req, base, watch)
        if info is not None:
            info.request_id = rid
        created, model = int(time.time()), self.config.model_name

        def event(choice: CompletionChoice) -> str:
            usage = running_usage(choices, req.n) if req.continuous_usage else None
            return sse_event(Completion(id=rid, created=created, model=model, choices=[choice], usage=usage))

        async def events() -> AsyncIterator[str]:
            # each choice's text_offset goes on across its chunks (after the echoed prompt), as
            # in the answer that is not streamed
            offsets = [0] * len(choices)
            # echo with logprobs: the prompt's logprobs come with a choice's first delta, so its
            # echo is sent then (so is a truncated prompt's, known then too); otherwise at once
            scores_echo = req.echo and (req.logprobs is not None or req.truncate_prompt_tokens is not None)
            echoed: set[int] = set()
            try:
                if req.echo and not scores_echo:
                    for c in choices:
                        text = self._prompt_text(prompts[c.index // req.n])
                        offsets[c.index] = len(text)
                        yield event(CompletionChoice(index=c.index, text=text))
                async for index, d in merge_choices(choices):
                    if scores_echo and index not in echoed:
                        echoed.add(index)
                        state = choices[index].state  # (the delta's own fields first: it may not be absorbed yet)
                        ids = getattr(d, "prompt_token_ids", None) or state.prompt_token_ids
                        text = self._echo_text(req, prompts[index // req.n], ids)
                        lp = None if req.logprobs is None else self.tokens.echoed_prompt_logprobs(
                            ids, getattr(d, "prompt_logprobs", None) or state.prompt_logprobs, req.logprobs,
                            self._as_ids(req))
                        offsets[index] = lp.end_offset if lp is not None else len(text)
                        yield event(CompletionChoice(index=index, text=text, logprobs=lp))
                    if d.finished:
                        _check_finished([choices[index].state])
                    lp = (self.tokens.completion_logprobs(d.new_token_ids or [], d.logprobs or [],
                                                          d.top_logprobs or [], offset=offsets[index],
                                                          as_ids=self._as_ids(req))
                          if req.logprobs is not None and d.new_token_ids else None)
                    if lp is not None and lp.tokens:
                        offsets[index] = lp.end_offset
                    if d.new_text or lp is not None or d.finished:
                        yield event(CompletionChoice(index=index, text=d.new_text or "", logprobs=lp,
                                                     finish_reason=d.finish_reason if d.finished else None))
                if req.include_usage:
                    yield sse_event(Completion(id=rid, created=created, model=model, choices=[],
                                               usage=prompts_usage([c.state for c in choices], req.n)))
            except Exception as exc:
                yield error_event(exc, route, rid)
            finally:  # every end: done, an error or abort, the client gone (request_watch.py)
                watch.end(choices)
            yield DONE

        async def close() -> None:
            await close_all(choices)
            watch.end(choices)  # a client gone while an event was sent: events() may never resume

        return events(), close

    async def _start_completion(self, req: CompletionRequest, base: str, watch: RequestWatch):
        self.check_model(req.model)
        prompts = req.prompts
        if len(prompts) > self.config.max_completion_prompts:
            raise InvalidInputError(f"prompt holds {len(prompts)} prompts; this server takes at most "
                                    f"{self.config.max_completion_prompts} per request (max_completion_prompts)")
        self._check_slots(len(prompts) * req.n)
        # echo with logprobs scores the prompt (vLLM: its prompt logprobs, the first token's None)
        scored = max(req.logprobs, req.prompt_logprobs or 0) if req.echo and req.logprobs is not None else None
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(req.n):
                i = p * req.n + j
                # one choice per prompt scores it (the same prompt, the same numbers; n copies held n
                # times the memory); streamed, each choice's echo takes its own first delta's
                params = self._sampling(req, req.logprobs, j, prompt_logprobs=scored, scores_prompt=j == 0 or req.stream)
                choices.append(ChoiceStream(i, self.engine.generate_prompt(prompt, params, request_id=f"{base}-{i}",
                                                                           priority=req.priority,
                                                                           cache_salt=req.cache_salt),
                                           on_tokens=watch.tokens))
        await watch.start(choices)
        return choices, prompts

    # ---- helpers ----------------------------------------------------------------------------
    def _sampling(self, req: SamplingFields, logprobs: int | None, choice: int, **kw: Any) -> SamplingParams:
        """``sampling_params`` with this service's default max_tokens and generation defaults."""
        return sampling_params(req, logprobs, choice, self.config.default_max_tokens, defaults=self.defaults, **kw)

    def _check_slots(self, choices: int) -> None:
        """Each choice takes one of the engine's ``max_queue`` admission slots: a request with more
        choices than there are slots is refused as what it is (400), not as a 429 no retry can end
        (a batch line would wait for room forever)."""
        slots = getattr(getattr(self.engine, "config", None), "max_queue", None)
        if isinstance(slots, int) and choices > slots:
            raise InvalidInputError(f"the request has {choices} choices (prompts x n), more than the {slots} requests "
                                    f"this server admits at once (--max-queue)")

    def check_model(self, model: str | None) -> None:
        """A request naming another model than this server's (its name or an alias) is a 404 (None: this one)."""
        if model is not None and model not in (names := (self.config.model_name, *self.config.model_aliases)):
            raise APIError(404, f"model {echo(model)} does not exist; this server serves {', '.join(map(repr, names))}",
                           param="model", code="model_not_found")

    def _as_ids(self, req: SamplingFields) -> bool:
        """Whether logprob entries name tokens as "token_id:<id>" (the request's field, else the server's)."""
        own = req.return_tokens_as_token_ids
        return self.config.tokens_as_ids if own is None else own

    def _echo_text(self, req: CompletionRequest, prompt: str | list[int], ran: list[int] | None) -> str:
        """The prompt an echo repeats: the one given, or under truncate_prompt_tokens the tokens
        the engine ran (``ran``, when known)."""
        k = req.truncate_prompt_tokens
        if k is not None and ran is not None:
            # a text prompt was cut when the engine ran as many tokens as the limit allows
            limit = k if k > 0 else getattr(self.engine, "max_model_len", 0) - 1
            cut = len(ran) < len(prompt) if not isinstance(prompt, str) else len(ran) >= limit
            tok = getattr(self.engine, "tokenizer", None)
            if cut and tok is not None:
                return tok.decode(ran)
        return self._prompt_text(prompt)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise InvalidInputError("echo of a token-id prompt needs a tokenizer; this model has none")
        return tok.decode(prompt)
