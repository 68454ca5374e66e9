"""Offline multimodal API: ``MultimodalLLM(model_dir).chat(conversations, SamplingParams(...))``.

    from mm_pipeline.multimodal_llm import MultimodalLLM
    from llm_core import SamplingParams
    llm = MultimodalLLM("samples/demo-model")
    outs = llm.chat([
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/data/cat.png"}},
                                      {"type": "text", "text": "Describe this image."}]}],
        [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///data/a.mp4"}},
                                      {"type": "text", "text": "What happens?"}]}],
    ], SamplingParams(max_tokens=64, temperature=0.0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

All conversations run concurrently through one OmniEngine (so the engine batches their encoder work
and their LLM steps), up to its ``max_queue`` at a time: a call takes any number of them, the rest
start as earlier ones finish -- the more urgent first when the call gives priorities (the engine's
``priority`` queue policy: lower first, arrival order among equals; FIFO otherwise). Outputs are
llm_core ``RequestOutput`` objects in input order; a conversation whose media is broken comes back
with ``finish_reason == "error"``, ``.error`` saying why and
``.error_kind`` ("media", or an ``llm_core.ErrorKind``); the others still finish. Local paths are
allowed anywhere by default (this is the caller's own machine); pass ``allowed_local_dirs`` to
restrict them. ``close()`` may come from any thread: a call running then raises ``RuntimeError``
(its unfinished conversations aborted, none returned as if complete), and so does a call after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from contextlib import aclosing
from pathlib import Path
from typing import Any, Sequence

from llm_core.engine.outputs import ErrorKind, RequestOutput
from llm_core.engine.sampling import SamplingParams
from llm_core.kvcache.page_keys import check_cache_salt
from llm_core.llm import as_prompt_list
from mm_pipeline.prompt.messages import parse_messages
from mm_pipeline.prompt.template_options import TemplateOptions
from mm_pipeline.errors import InvalidInputError, MediaError, MMServeError, ServerBusy
from mm_pipeline.priority_slots import PrioritySlots
from mm_pipeline.runtime.chat_preparation import gather_or_cancel
from mm_pipeline.runtime.omni_engine import OmniEngine
from mm_pipeline.runtime.config import OmniEngineConfig

Conversation = list[dict[str, Any]]
log = logging.getLogger("mmserve.offline")
# how long close() waits for the running calls to end (their requests aborted) before it shuts the
# engine down anyway
CLOSE_GRACE_S = 10.0


class MultimodalLLM:
    """Own an OmniEngine and an event loop thread; run batches of conversations to completion."""

    def __init__(self, model_dir: str | Path, *, allowed_local_dirs: tuple[str, ...] = ("/",),
                 engine: OmniEngine | None = None, **config_fields: Any) -> None:
        """``config_fields`` are :class:`OmniEngineConfig` fields and its engine's ``EngineConfig``
        fields, by name (device, dtype, num_full_tokens, max_num_seqs, cache_dir, ...)."""
        if engine is None:
            config = OmniEngineConfig.from_kwargs(allowed_local_dirs=tuple(allowed_local_dirs), **config_fields)
            engine = OmniEngine.from_pretrained(model_dir, config)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="multimodal-llm-loop", daemon=True)
        self._thread.start()
        # guards _closed, _next_id and _calls: calls and close() may come from several threads
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._calls: set[concurrent.futures.Future] = set()  # the calls running now (their _all)
        # this object's requests in the engine at once: never more than it admits (max_queue), so a
        # call with more inputs waits for its own earlier ones instead of failing as overloaded; a
        # freed slot goes to the most urgent waiter, as the engine's queue orders them
        self._slots = PrioritySlots(engine.config.max_queue)

    @classmethod
    def from_engine(cls, engine: OmniEngine) -> "MultimodalLLM":
        """Wrap an existing engine (tests, benchmarks)."""
        return cls("", engine=engine)

    # ---- public API -------------------------------------------------------------------------
    def chat(self, conversations: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, priority: Sequence[int] | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """Answer each conversation (OpenAI-format messages); one conversation or a list of them.
        The keyword arguments are vLLM's ``LLM.chat`` ones, applied to every conversation, with the
        server's rules (prompt/template_options.py): e.g. ``chat_template_kwargs={"enable_thinking":
        False}``; a key the model's template does not read fails that conversation, naming it.
        ``tools``: OpenAI function definitions the template renders (as vLLM's ``LLM.chat(tools=...)``;
        the answers are not parsed for calls here: mm_pipeline/prompt/tool_calls.py does that).
        ``priority``: one per conversation, lower first, under the ``priority`` queue policy;
        ``cache_salt``: they share prefix-cache KV only with requests of the same salt."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        options = TemplateOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {},
                                  tuple(tools or ()))
        # malformed input raises here, before any work
        chats = [parse_messages(c, options) for c in conversations]
        params = self._params(sampling_params, len(chats))
        return self._run([dict(chat=c, params=p) for c, p in zip(chats, params)], priority, cache_salt)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Plain completions of text or token-id prompts (no chat template); ``priority`` and
        ``cache_salt`` as in ``chat``."""
        prompts = as_prompt_list(prompts)  # LLM.generate's prompt forms (a 1-D tensor is one prompt)
        params = self._params(sampling_params, len(prompts))
        return self._run([dict(prompt=p, params=sp) for p, sp in zip(prompts, params)], priority, cache_salt)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling a call without ``sampling_params`` uses -- the checkpoint's
        generation_config.json defaults (``generation_config`` / ``override_generation_config``)."""
        return self.engine.generation_defaults.sampling_params()

    def close(self) -> None:
        """Stop the engine and the event loop; idempotent, from any thread. Calls running in other
        threads end first: their requests are aborted and each raises RuntimeError. Returns once the
        engine and the loop thread are stopped. Later calls raise RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # the calls first, while the engine runs: their requests are aborted and detached as a
        # cancelled call's are (shutting the engine down under them would end them with "abort"
        # outputs that look finished)
        ending = asyncio.run_coroutine_threadsafe(self._end_calls(), self._loop)
        try:
            ending.result(CLOSE_GRACE_S)
        except concurrent.futures.TimeoutError:
            log.warning("calls still running %.0f s after close(); shutting the engine down under them", CLOSE_GRACE_S)
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_GRACE_S)
        with self._lock:
            stuck = list(self._calls)
        for call in stuck:  # one that ignored its cancel: the stopped loop will never finish it
            call.cancel()
        if self._thread.is_alive():  # a callback blocks the loop: leave it (a daemon thread)
            log.warning("the MultimodalLLM event loop did not stop within %.0f s", CLOSE_GRACE_S)
        else:
            self._loop.close()

    def __enter__(self) -> "MultimodalLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internal helpers -------------------------------------------------------------------
    def _params(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        sp = sp if sp is not None else self.get_default_sampling_params()
        params = [sp] * n if isinstance(sp, SamplingParams) else list(sp)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} inputs")
        return params

    def _run(self, jobs: list[dict[str, Any]], priority: Sequence[int] | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """``priority`` and ``cache_salt`` are checked for the whole call first (as LLM.generate:
        a wrong one is the call's mistake, not one conversation's), then go with every job."""
        ranks = [0] * len(jobs) if priority is None else list(priority)
        if len(ranks) != len(jobs):
            raise ValueError(f"{len(ranks)} priorities for {len(jobs)} inputs")
        llm = self.engine.runtime.llm
        problems = [p.message for p in map(llm.check_priority, ranks) if p is not None] if llm is not None else []
        if (salt_problem := check_cache_salt(cache_salt)) is not None:
            problems.append(salt_problem)
        if problems:
            raise ValueError(problems[0])
        for job, rank in zip(jobs, ranks):
            job.update(priority=rank, cache_salt=cache_salt)
        # checked and submitted under the lock: a call submitted before close() is one close() ends
        # (its task exists before close's own runs on the loop); one after it never reaches the loop
        with self._lock:
            if self._closed:  # the loop is stopped: a job sent to it would never run, nor the call return
                raise RuntimeError("MultimodalLLM is closed")
            ids = [f"mmllm-{self._next_id + i}" for i in range(len(jobs))]
            self._next_id += len(jobs)
            call = asyncio.run_coroutine_threadsafe(self._all(ids, jobs), self._loop)
            self._calls.add(call)
        try:
            return call.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RuntimeError("MultimodalLLM was closed while this call was running; "
                                   "its unfinished inputs were aborted") from None
            raise
        except BaseException:
            call.cancel()  # interrupted here (Ctrl-C): end its jobs too (_all cleans up)
            raise
        finally:
            with self._lock:
                self._calls.discard(call)

    async def _end_calls(self) -> None:
        """Cancel every other task of this object's loop (the calls' and what they started) and
        wait for them: each call's requests are aborted and its slots freed."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _all(self, ids: list[str], jobs: list[dict[str, Any]]) -> list[RequestOutput]:
        """Every job's output in order. When one raises, the call fails: the others are cancelled and
        awaited first (gather alone leaves them running, unseen, holding engine slots the next call
        would be refused for), so the engine is left as before the call. The jobs start (and ask
        for slots) the most urgent first, so the free slots go to them too."""
        starts = sorted(range(len(jobs)), key=lambda i: jobs[i]["priority"])  # stable: input order among equals
        started = {i: asyncio.ensure_future(self._one(ids[i], jobs[i])) for i in starts}
        return await gather_or_cancel([started[i] for i in range(len(jobs))])

    async def _one(self, rid: str, job: dict[str, Any]) -> RequestOutput:
        last: RequestOutput | None = None
        try:
            async with self._slots.slot(job["priority"]):
                async with aclosing(self.engine.outputs(job["params"], chat=job.get("chat"), prompt=job.get("prompt"),
                                                        request_id=rid, priority=job["priority"],
                                                        cache_salt=job["cache_salt"])) as outs:
                    async for out in outs:
                        last = out
        except (MediaError, InvalidInputError, ServerBusy, ValueError) as exc:
            # this conversation fails, the others go on (admission overload still raises: with
            # _slots it means someone else shares the engine and filled it)
            kind = exc.kind if isinstance(exc, MMServeError) else ErrorKind.INVALID_INPUT.value
            return RequestOutput(request_id=rid, prompt_token_ids=[], finished=True, finish_reason="error", text="",
                                 error=f"{type(exc).__name__}: {exc}", error_kind=kind)
        assert last is not None and last.finished
        return last
