"""OmniEngine: the async multimodal generation API the server, CLI and offline API share.

    generate(messages) ─► parse (event loop, cheap) ─► ingest + hash + plan each media item
        (worker pool: sizes from the cache manifest or metadata) ─► prompt layout (placeholders
        sized up front) ─► EmbeddingStream ─► LLM request added NOW ─► units stream in as they are
        found in the cache, joined, or decoded+encoded ─► token deltas back through an asyncio.Queue

The engine thread (:class:`EngineLoop`) runs LLM steps and encoder batches; the event loop only
awaits queues fed with ``call_soon_threadsafe``. A media error surfaces before the first delta
(no token can be sampled before every placeholder has its rows). Closing the iterator early
(client disconnect) aborts the request: its KV pages, stream rows and unit claims are released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

from llm_core.engine.detokenizer import IncrementalDetokenizer
from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.outputs import RequestOutput
from llm_core.engine.sampling.prompt_logprobs import PromptLogprobs
from llm_core.engine.sampling import SamplingParams
from llm_core.kvcache.page_keys import check_cache_salt
from mm_pipeline.errors import InvalidInputError, InvalidMessageError, OverloadedError
from mm_pipeline.media.flows import flow as pool_flow
from mm_pipeline.prompt.messages import ChatRequest, parse_messages
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.components import OmniRuntime
from mm_pipeline.runtime.media_feed import MediaFeed
from mm_pipeline.runtime.stats import OmniStats


@dataclass
class GenerationDelta:
    """What one engine step added to a request, plus its running totals.

    A request that ends in error says why in ``error`` and which kind of failure it is in
    ``error_kind`` (an ``ErrorKind`` of the text engine; ``mm_pipeline.errors.generation_error``
    makes it a typed error). Media, message and overload errors never arrive as deltas: they
    raise before the first one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[float] | None
    # by token id: distinct tokens may decode to the same text (byte tokens of a multi-byte
    # character all read U+FFFD), so the response builder turns ids into text per entry
    top_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    first_token_time: float | None
    error: str | None = None
    error_kind: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)  # first delta only
    # encoder units of this request's media found in the encoder cache when it was planned
    # (not encoded again); the same on every delta, so the first one already says it
    encoder_cache_hits: int = 0
    # params.prompt_logprobs: prompt tokens 1.. (token 0 has none), on the first delta that has them
    # (the one with the first token)
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)


__all__ = ["GenerationDelta", "OmniEngine", "OmniEngineConfig"]


class OmniEngine:
    """Multimodal generation over one omni model (see module doc)."""

    def __init__(self, runtime: OmniRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.tokenizer = runtime.model.tokenizer
        self.model_name = runtime.model.name
        self._in_flight = 0
        self._ids = itertools.count()
        self._stats = OmniStats.collect(runtime, 0)
        runtime.loop.on_stats = self._publish_stats
        self.runtime.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: OmniEngineConfig | None = None) -> "OmniEngine":
        return cls(OmniRuntime.load(model_dir, config or OmniEngineConfig()))

    # ---- public API -------------------------------------------------------------------------
    async def generate(self, messages: list[dict], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream the answer to OpenAI-format chat ``messages`` (see chat_request for the parts).
        ``priority``: lower first under the ``priority`` queue policy (``LLMEngine.check_priority``);
        ``cache_salt``: prefix-cache KV and encoder-cache entries (media keys salted,
        content_hash.salted_media_key) are shared only with requests of the same salt."""
        chat = parse_messages(messages)  # malformed messages fail before admission
        hits: list[int] = []
        async with aclosing(self.outputs(params, chat=chat, request_id=request_id, on_planned=hits.append,
                                         priority=priority, cache_salt=cache_salt)) as outs:
            async for delta in self._deltas(outs, params):
                delta.encoder_cache_hits = sum(hits)
                yield delta

    async def generate_prompt(self, prompt: str | list[int], params: SamplingParams, *,
                              request_id: str | None = None, priority: int = 0,
                              cache_salt: str | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream a completion of a plain text or token-id prompt (no chat template, no media)."""
        async with aclosing(self.outputs(params, prompt=prompt, request_id=request_id, priority=priority,
                                         cache_salt=cache_salt)) as outs:
            async for delta in self._deltas(outs, params):
                yield delta

    async def prompt_token_ids(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                               add_special_tokens: bool = False) -> list[int]:
        """The prompt ``generate(messages)`` / ``generate_prompt(prompt)`` would prefill, without
        running it (``POST /tokenize``). Give ``messages`` or ``prompt``.

        A chat goes through the very preparation ``generate`` runs (``OmniRuntime.prepare_chat``):
        the chat template with the messages' options, and each media item ingested and planned --
        fetched, hashed and sized from the cache manifest or its metadata (an image's header, a
        video's probe; an audio clip or a video's sound decoded to count its segments) -- so its
        placeholders are expanded to the rows the encoders will fill. Nothing is encoded and no KV
        is used; cached media is sized from its manifest alone (``layout_only``: its encoder rows,
        megabytes for a long video, are neither read nor counted as cache hits). The plans are then
        dropped, as a request that fails after planning drops them (decoded inputs and early
        decodes are released with them). Admitted like a request (``max_queue``: 429 when full).
        The checks are a request's too: a prompt that leaves no room in the context is a
        ``ContextLengthError``, bad media the same typed error.
        ``add_special_tokens`` (text only): the tokenizer's own additions around the text (a prompt
        is served without them)."""
        if (messages is None) == (prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        if prompt is not None and self.tokenizer is None:
            raise InvalidMessageError("text prompt given but the model has no tokenizer")
        chat = None if messages is None else parse_messages(messages)  # malformed messages fail first
        self._admit()
        try:
            with pool_flow(f"tokenize-{next(self._ids)}"):  # its own turn in the pools, as a request's
                if chat is None:
                    return await self.runtime.tokenize(prompt, add_special_tokens=add_special_tokens)
                return (await self.runtime.prepare_chat(chat, layout_only=True)).token_ids
        finally:
            self._in_flight -= 1

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults of requests that leave a field unset (the checkpoint's
        generation_config.json under --generation-config auto); the server and jobs apply them."""
        return self.runtime.generation_defaults

    @property
    def max_model_len(self) -> int:
        """The longest context one request can hold, prompt and output (the model's limit capped at
        the Full KV pool): what a longer prompt is refused against."""
        return self.runtime.max_model_len

    async def outputs(self, params: SamplingParams, *, chat: ChatRequest | None = None,
                      prompt: str | list[int] | None = None,
                      request_id: str | None = None,
                      on_planned: Callable[[int], None] | None = None,
                      priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative :class:`RequestOutput` after every step of one request (the
        offline API's view; ``generate`` turns these into deltas). Give ``chat`` or ``prompt``.
        ``on_planned(n)``: called once the chat's media is planned, with the number of encoder
        units found in the encoder cache (before any output). ``priority``, ``cache_salt``: see
        ``generate``; a value the engine would refuse fails here, before any media is read."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be llm_core.SamplingParams, got {type(params).__name__}")
        if (chat is None) == (prompt is None):
            raise ValueError("give exactly one of chat and prompt")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InvalidMessageError("text prompt given but the model has no tokenizer; pass token ids")
        if self.runtime.llm is not None and (problem := self.runtime.llm.check_priority(priority)) is not None:
            raise InvalidInputError(problem.message)
        if (salt_problem := check_cache_salt(cache_salt)) is not None:
            raise InvalidInputError(salt_problem)
        token_ids = None if prompt is None or isinstance(prompt, str) else [int(t) for t in prompt]
        self._admit()
        rid = request_id or f"omni-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rt = self.runtime
        started = False
        feed: MediaFeed | None = None
        checkpoints: tuple[int, ...] = ()
        try:
            # the worker pools and the encoder queue take turns between requests, the more urgent first
            # (media/flows.py): this request's calls, those of the tasks started here (its video's chunk
            # decodes) and its encoder jobs are its flow
            with pool_flow(rid, priority):
                if params.structured_outputs is not None:  # a bad constraint fails before any media is read
                    await rt.compile_grammar(params.structured_outputs)
                if chat is not None:
                    prepared = await rt.prepare_chat(chat, truncate=params.truncate_prompt_tokens is not None,
                                                     salt=cache_salt)
                    token_ids, checkpoints = prepared.token_ids, prepared.checkpoints
                    if on_planned is not None:  # now: starting the feed hands plan.cached to the sinks and empties it
                        on_planned(sum(len(p.cached) for p in prepared.plans))
                    if self.config.stream_embeddings:
                        feed = rt.open_media(prepared, rid)
                        feed.deliver_cached()
                        if feed.stream.error is not None:
                            raise feed.stream.error
                    else:  # every unit is decoded and encoded before prefill starts
                        progressed = asyncio.Event()
                        feed = rt.open_media(prepared, rid,
                                             on_progress=lambda: loop.call_soon_threadsafe(progressed.set))
                        feed.start()
                        while not feed.stream.complete and feed.stream.error is None:
                            await progressed.wait()
                            progressed.clear()
                        if feed.stream.error is not None:
                            raise feed.stream.error
                elif token_ids is None:  # a text prompt: tokenize off the event loop
                    token_ids = await rt.tokenize(prompt, keep_last=params.truncate_prompt_tokens)
                stream = None if feed is None else feed.stream
                rt.submit(rid, token_ids, params, stream, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out),
                          checkpoints, priority, cache_salt)
                started = True
                if feed is not None and self.config.stream_embeddings:
                    feed.start()
            while True:
                out = await queue.get()
                # a consumer that fell behind (a slow client, a Ray stream) gets the steps since its
                # last read as one output, not one per token: outputs are cumulative but for the
                # step's new tokens, so the latest one with every queued step's new tokens is the same
                while not out.finished and not queue.empty():
                    later = queue.get_nowait()
                    out = dataclasses.replace(later, new_token_ids=out.new_token_ids + later.new_token_ids)
                if stream is not None and stream.error is not None and not out.token_ids:
                    raise stream.error  # a media unit failed; the request was aborted because of it
                yield out
                if out.finished:
                    return
        finally:
            self._in_flight -= 1
            if started:
                rt.abort(rid)
                rt.detach(rid)
            if feed is not None:
                feed.close()

    def set_file_resolver(self, fn: Callable[[str], tuple[bytes | Path, str | None]], *,
                          local_files: bool = False) -> None:
        """``fn(file_id) -> (bytes or path, filename)`` for ``{"type": "file"}`` content parts;
        an unknown id must raise ``KeyError``. ``local_files``: the ids stand for the caller's own
        local files and ``filename`` is the file's path (the caption job): a media error then names
        that path (``image from local file '/data/a.jpg' cannot be read``), not an upload."""
        self.runtime.planner.file_resolver = fn
        self.runtime.planner.local_files = local_files

    @property
    def requests_in_flight(self) -> int:
        """Admitted requests not finished yet, live (admission is counted on the event loop, so this
        is current even while the engine thread is busy in a long step; the stats snapshot is not)."""
        return self._in_flight

    def stats(self) -> OmniStats:
        """The last snapshot the engine thread published (mm_pipeline/runtime/stats.py): as of its
        last loop iteration (a step, or an idle wake-up at least every 50 ms). Any thread: it reads
        no engine or cache structure."""
        return self._stats

    def end_requests(self) -> int:
        """Abort every request in flight and refuse new ones (``ServerBusy``, a 503): what a server
        whose shutdown grace period ran out does instead of cancelling its handlers. Any thread."""
        return self.runtime.loop.end_all()

    def shutdown(self) -> None:
        self.runtime.shutdown()

    # ---- internal helpers -------------------------------------------------------------------
    def _admit(self) -> None:
        if self._in_flight >= self.config.max_queue:
            raise OverloadedError(f"{self._in_flight} requests in flight (max_queue {self.config.max_queue}); "
                                  f"retry later")
        self._in_flight += 1

    def _publish_stats(self) -> None:
        """Engine thread, after every loop iteration: one new snapshot, published by one swap."""
        self._stats = OmniStats.collect(self.runtime, self._in_flight)

    async def _deltas(self, outs: AsyncIterator[RequestOutput], params: SamplingParams
                      ) -> AsyncIterator[GenerationDelta]:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        first_token_time: float | None = None
        sent = 0
        first = True
        prompt_sent = False
        async for out in outs:
            new = out.new_token_ids
            if new and first_token_time is None:
                first_token_time = time.time()
            if not out.finished:
                text = detok.push(new)
            elif out.text is not None:  # the engine's final text, "" too: a stop string with nothing
                text = detok.finish(out.text)  # before it -- its held-back start must not be sent
            else:  # not decoded by the engine: decode here, this output's tokens included
                text = detok.push(new) + detok.finish(None)
            lps = tops = None
            if out.logprobs is not None and out.top_logprobs is not None:
                lps = out.logprobs[sent:sent + len(new)]
                tops = [dict(d) for d in out.top_logprobs[sent:sent + len(new)]]
            sent += len(new)
            prompt_lps = None
            if out.prompt_logprobs is not None and not prompt_sent:
                prompt_sent = True
                prompt_lps = PromptLogprobs(1, tuple(out.prompt_logprobs[1:]), tuple(out.prompt_logprob_ranks[1:]),
                                            tuple(out.prompt_top_logprobs[1:]))
            yield GenerationDelta(out.request_id, list(new), text, lps, tops, out.finished, out.finish_reason,
                                  len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens,
                                  first_token_time, out.error, out.error_kind,
                                  out.prompt_token_ids if first else None, prompt_logprobs=prompt_lps)
            first = False

