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
import itertools
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from llm_core.engine.outputs import RequestOutput
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.prompt.messages import ChatRequest, InvalidMessageError, parse_messages
from mm_pipeline.runtime.detokenizer import IncrementalDetokenizer
from mm_pipeline.runtime.embedding_stream import EmbeddingStream
from mm_pipeline.encode.batcher import UnitSink
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.components import OmniRuntime


class OverloadedError(Exception):
    """Too many requests in flight (HTTP 429 with Retry-After)."""

    status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class GenerationDelta:
    """What one engine step added to a request, plus its running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    first_token_time: float | None
    error: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)  # first delta only
    # encoder units of this request's media found in the encoder cache when it was planned
    # (not encoded again); the same on every delta, so the first one already says it
    encoder_cache_hits: int = 0


__all__ = ["GenerationDelta", "OmniEngine", "OmniEngineConfig", "OverloadedError"]


class OmniEngine:
    """Multimodal generation over one omni model (see module doc)."""

    def __init__(self, runtime: OmniRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.tokenizer = runtime.model.tokenizer
        self.model_name = runtime.model.name
        self._in_flight = 0
        self._ids = itertools.count()
        self.runtime.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: OmniEngineConfig | None = None) -> "OmniEngine":
        return cls(OmniRuntime.load(model_dir, config or OmniEngineConfig()))

    # ---- public API -------------------------------------------------------------------------
    async def generate(self, messages: list[dict], params: SamplingParams, *,
                       request_id: str | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream the answer to OpenAI-format chat ``messages`` (see chat_request for the parts)."""
        chat = parse_messages(messages)  # malformed messages fail before admission
        hits: list[int] = []
        async with aclosing(self.outputs(params, chat=chat, request_id=request_id, on_planned=hits.append)) as outs:
            async for delta in self._deltas(outs, params):
                delta.encoder_cache_hits = sum(hits)
                yield delta

    async def generate_prompt(self, prompt: str | list[int], params: SamplingParams, *,
                              request_id: str | None = None) -> AsyncIterator[GenerationDelta]:
        """Stream a completion of a plain text or token-id prompt (no chat template, no media)."""
        async with aclosing(self.outputs(params, prompt=prompt, request_id=request_id)) as outs:
            async for delta in self._deltas(outs, params):
                yield delta

    async def outputs(self, params: SamplingParams, *, chat: ChatRequest | None = None,
                      prompt: str | list[int] | None = None,
                      request_id: str | None = None,
                      on_planned: Callable[[int], None] | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative :class:`RequestOutput` after every step of one request (the
        offline API's view; ``generate`` turns these into deltas). Give ``chat`` or ``prompt``.
        ``on_planned(n)``: called once the chat's media is planned, with the number of encoder
        units found in the encoder cache (before any output)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be llm_core.SamplingParams, got {type(params).__name__}")
        if (chat is None) == (prompt is None):
            raise ValueError("give exactly one of chat and prompt")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InvalidMessageError("text prompt given but the model has no tokenizer; pass token ids")
        token_ids = None if prompt is None or isinstance(prompt, str) else [int(t) for t in prompt]
        self._admit()
        rid = request_id or f"omni-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rt = self.runtime
        started = False
        plans: list = []
        sinks: list[list[UnitSink]] = []
        stream: EmbeddingStream | None = None
        try:
            if chat is not None:
                prepared = await rt.prepare_chat(chat)
                token_ids, plans = prepared.token_ids, prepared.plans
                if on_planned is not None:  # now: planner.start hands plan.cached to the sinks and empties it
                    on_planned(sum(len(p.cached) for p in plans))
                progressed = asyncio.Event()

                def wake_and_signal() -> None:  # streaming off: the request waits on the event loop
                    rt.loop.wake()
                    loop.call_soon_threadsafe(progressed.set)

                on_progress = rt.loop.wake if self.config.stream_embeddings else wake_and_signal
                stream = EmbeddingStream(len(token_ids), prepared.spans, rt.hidden_size, on_progress=on_progress)
                sinks = [[_unit_sink(stream, s, rt, rid) for s in spans] for spans in prepared.spans_of_plan]
            elif token_ids is None:  # a text prompt: tokenize off the event loop
                token_ids = await rt.pool.run(self._encode_text, prompt)
            if stream is not None and not self.config.stream_embeddings:
                # Streaming off: every unit is decoded and encoded before prefill starts.
                for plan, plan_sinks in zip(plans, sinks):
                    rt.planner.start(plan, plan_sinks)
                while not stream.complete and stream.error is None:
                    await progressed.wait()
                    progressed.clear()
                if stream.error is not None:
                    raise stream.error
            rt.loop.add_request(rid, token_ids, params, stream,
                                lambda out: loop.call_soon_threadsafe(queue.put_nowait, out),
                                **rt.extra_request_args(stream))
            started = True
            if stream is None or self.config.stream_embeddings:
                for plan, plan_sinks in zip(plans, sinks):
                    rt.planner.start(plan, plan_sinks)
            while True:
                out = await queue.get()
                if stream is not None and stream.error is not None and not out.token_ids:
                    raise stream.error  # a media unit failed; the request was aborted because of it
                yield out
                if out.finished:
                    return
        finally:
            self._in_flight -= 1
            if started:
                rt.loop.abort(rid)
                rt.loop.detach(rid)
            for plan, plan_sinks in zip(plans, sinks):
                rt.planner.detach(plan, plan_sinks)
            if stream is not None:
                stream.release()

    def set_file_resolver(self, fn: Callable[[str], tuple[bytes | Path, str | None]]) -> None:
        """``fn(file_id) -> (bytes or path, filename)`` for ``{"type": "file"}`` content parts;
        an unknown id must raise ``KeyError``."""
        self.runtime.planner.file_resolver = fn

    def stats(self) -> dict[str, Any]:
        """in_flight (admitted requests), running / waiting / queue_depth (scheduler), kv_pool
        (pages per pool), encoder_cache (hits per tier), encoder (batcher counters), media (decode
        and cache counters), prefix_cache, engine_loop, decode_pool. Safe from any thread."""
        return {"in_flight": self._in_flight, **self.runtime.stats()}

    def shutdown(self) -> None:
        self.runtime.shutdown()

    # ---- internal helpers -------------------------------------------------------------------
    def _admit(self) -> None:
        if self._in_flight >= self.config.max_queue:
            raise OverloadedError(f"{self._in_flight} requests in flight (max_queue {self.config.max_queue}); "
                                  f"retry later")
        self._in_flight += 1

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _deltas(self, outs: AsyncIterator[RequestOutput], params: SamplingParams
                      ) -> AsyncIterator[GenerationDelta]:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        first_token_time: float | None = None
        sent = 0
        first = True
        async for out in outs:
            new = out.new_token_ids
            if new and first_token_time is None:
                first_token_time = time.time()
            text = detok.finish(out.text or None) if out.finished else detok.push(new)
            lps = tops = None
            if out.logprobs is not None and out.top_logprobs is not None:
                lps = out.logprobs[sent:sent + len(new)]
                tops = [{detok.token_text(t): lp for t, lp in d.items()}
                        for d in out.top_logprobs[sent:sent + len(new)]]
            sent += len(new)
            yield GenerationDelta(out.request_id, list(new), text, lps, tops, out.finished, out.finish_reason,
                                  len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens,
                                  first_token_time, out.error, out.prompt_token_ids if first else None)
            first = False


def _unit_sink(stream: EmbeddingStream, span_index: int, rt: OmniRuntime, rid: str) -> UnitSink:
    """Deliver one unit's rows into its span; an error (or rows that do not fit) fails the request."""
    def sink(rows, error) -> None:
        if error is None:
            try:
                stream.fill(span_index, rows)
                return
            except Exception as exc:  # wrong-sized rows: fail this request, not the deliverer
                error = exc
        stream.fail(error)
        rt.loop.abort(rid)  # its queue then gets the abort output; outputs() raises the error
    return sink
