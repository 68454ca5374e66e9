"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

    add_request / abort  (any thread)  -> pending queues (under a lock); a prompt the engine cannot
                                          serve becomes an early "error" output right away
    step()               (engine thread):
        drain queues: early outputs out, new requests to the Scheduler's waiting queue, aborts end
        -> Scheduler.schedule (a request the SWA pool cannot hold even alone ends with "error")
        -> ModelRunner.run: input preparation, forward, logits of the sampling rows, Sampler
           (an exception ends only the request it came from with "error": the sampler isolates
           rows, a failing step is run again without the entries that fail alone)
        -> per entry, its sampled tokens (1; a speculative verify entry 1..k+1) appended in order,
           the stop checks after each in Request.check_stop's order (EOS / stop token id, stop
           string, length; a stop drops the rest)
        -> Scheduler.after_step (progress, rollback of rejected drafts, prefix-cache inserts, SWA
           release behind the window); then a stopped request gives its pages back
        -> outputs (a final text's decode that raises ends only its request with "error", text "")
    stats()              (any thread): the last EngineStats snapshot the engine thread published at
                         the end of a step (llm_core/engine/stats.py)

The engine itself knows token ids and embedding rows; the model runner knows tensors. Text appears
only in stop-string checks (incremental, llm_core/engine/detokenizer.py) and in finished outputs
(one decode each).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from llm_core.engine.admission import Admission
from llm_core.engine.model_runner import ModelRunner, StepResult, run_isolated, scratch_prefill
from llm_core.engine.engine_config import EngineConfig, context_limit, pool_sizing
from llm_core.kvcache.dual_pool import DualKVPool, KVLayout, default_kv_budget_bytes
from llm_core.engine.outputs import ErrorKind, RequestError, RequestOutput
from llm_core.engine.sampling.logits_processing import NoTokenAllowed
from llm_core.engine.request import EmbeddingSource, Request
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.scheduler import Scheduler
from llm_core.engine.speculative import build_speculative
from llm_core.engine.stats import EngineStats
from llm_core.engine.structured.compiler import GrammarCompiler
from llm_core.engine.structured.params import StructuredOutputsParams
from llm_core.kvcache.prefix_cache import PrefixCache
from kernels import native

# The prefix cache's stats walk its whole tree, too slow for every step of a big cache: while
# requests run they are re-read at most this often; a step that leaves the engine idle re-reads them.
PREFIX_STATS_INTERVAL_S = 1.0
log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over one model and one dual KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        engine_config: EngineConfig | None = None,
        *,
        tokenizer=None,
        prefix_cache: PrefixCache | None = None,
        enable_prefix_caching: bool | None = None,
    ) -> None:
        """``enable_prefix_caching`` overrides the config's flag; an explicit ``prefix_cache`` wins."""
        self.model_config = model.config
        self.config = engine_config or EngineConfig()
        self.tokenizer = tokenizer
        native.set_enabled(self.config.native_cpu_kernels)  # before the runner lays out the weights
        self.runner = ModelRunner(model, self.config.page_size, self.config.seed, huge_pages=self.config.huge_pages,
                                  persistent_decode_batch=self.config.persistent_decode_batch)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        if self.device.type == "cpu" and self.dtype == torch.float32 and native.enabled():
            native.build_all()  # compiled (or loaded from the disk cache) now, not in the first step
        # this rank's KV heads (all of them in one process; a share under tensor parallelism)
        layout = model.kv_layout() if hasattr(model, "kv_layout") else KVLayout.from_model_config(self.model_config)
        # --- speculative decoding hook (llm_core/engine/speculative/): MTP layers keep SWA-pool KV
        self.speculative = build_speculative(model, self.runner, tokens=self.config.mtp_tokens,
                                             mode=self.config.speculative_layers,
                                             adaptive=self.config.speculative_adaptive)
        if self.speculative is not None:
            layout = self.speculative.kv_layout(layout)
        self._stepper = self.speculative or self.runner
        self.max_model_len = context_limit(self.config.max_model_len, self.model_config.max_position_embeddings)
        if enable_prefix_caching is None:
            enable_prefix_caching = self.config.enable_prefix_caching
        self.pool = DualKVPool(layout, page_size=self.config.page_size, dtype=self.dtype, device=self.device,
                               huge_pages=self.config.huge_pages,
                               **pool_sizing(self.config, layout, dtype=self.dtype, device=self.device,
                                             max_model_len=self.max_model_len,
                                             prefix_caching=enable_prefix_caching,
                                             # a rank group's: the smallest rank's (step_mirror.py)
                                             default_budget=getattr(model, "kv_budget_bytes",
                                                                    default_kv_budget_bytes)).__dict__)
        allocate_kv = getattr(model, "allocate_kv", None)  # a rank group: the other ranks' shares, now
        if allocate_kv is not None:
            allocate_kv(self.pool)
        # The longest prompt + output one request can hold: a lone request gets the whole Full pool
        # and no more (vLLM refuses to start with a pool below max_model_len; this engine caps the
        # context instead). A longer prompt is refused at add_request and generation that reaches
        # it ends with "length", as at max_model_len -- never a preemption or an "error" part-way.
        self.max_context_tokens = min(self.max_model_len, self.pool.full.num_pages * self.config.page_size)
        # fixed-shape decode steps; under MTP its plain and verify steps replay them too (the draft
        # steps stay eager: docs/speculative.md)
        mode = self.config.decode_mode(self.device)
        self.decode_warmup_s = 0.0 if mode is None else self.runner.enable_decode_graphs(
            self.pool, buckets=self.config.decode_buckets, mode=mode, max_model_len=self.max_model_len)
        if prefix_cache is None and enable_prefix_caching:
            from llm_core.kvcache.prefix_cache_factory import build_prefix_cache

            prefix_cache = build_prefix_cache(self.pool, self.config, model)
        drafts = None if self.speculative is None else (
            lambda req, running: self.speculative.num_draft_tokens(req, running, self.max_context_tokens))
        self.scheduler = Scheduler(self.config.scheduler_config, self.pool, layout.window, prefix_cache,
                                   self.config.queue, draft_tokens=drafts)
        self.prefix_cache = self.scheduler.prefix_cache
        # structured outputs: grammars compiled (worker process, cached) from the tokenizer's vocabulary
        grammars = None if self.config.structured_outputs_backend == "none" or tokenizer is None else \
            GrammarCompiler(tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids,
                            timeout_s=self.config.grammar_compile_timeout_s)
        self.admission = Admission(vocab_size=self.model_config.vocab_size, max_context_tokens=self.max_context_tokens,
                                   max_model_len=self.max_model_len, tokenizer=tokenizer, grammars=grammars,
                                   queue_policy=self.scheduler.queue_policy,
                                   eos_token_ids=tuple(self.model_config.eos_token_ids),
                                   checkpoints_per_request=self.config.prefix_checkpoints_per_request)
        self.last_step_progressed = False
        self._lock = threading.Lock()
        self._pending_add: list[Request] = []
        self._pending_abort: list[str] = []
        self._live: dict[str, Request] = {}
        self._early_outputs: list[RequestOutput] = []
        self._arrivals = itertools.count()
        self._prefix_stats: dict[str, int] = {}
        self._prefix_stats_at = float("-inf")
        self._generation_tokens = 0  # counter (stats): tokens handed to requests
        self._stats: EngineStats = self.publish_stats()

    # ---- public API -------------------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler | None:
        """The structured-output grammar compiler (None: such requests are refused); one owner, the
        admission checks, which refuse those requests when it is None."""
        return self.admission.grammars

    @grammars.setter
    def grammars(self, compiler: GrammarCompiler | None) -> None:
        self.admission.grammars = compiler

    def check_priority(self, priority: int) -> RequestError | None:
        """Why a request cannot have this ``priority`` (None if it can; ``Admission.check_priority``)."""
        return self.admission.check_priority(priority)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` now (any thread; ``Admission.compile_grammar``): servers call it off
        their event loop before admitting a request, so a miss never runs inside ``add_request``."""
        self.admission.compile_grammar(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        embeds: EmbeddingSource | None = None,
        extra_keys: tuple[tuple[int, int, bytes], ...] = (),
        checkpoints: tuple[int, ...] = (),
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request (thread-safe). A prompt the engine cannot serve does not raise: it comes
        back from the next step() as an output with finish_reason "error". ``extra_keys``: (start, end,
        content key) over prompt positions, mixed into the prefix-cache keys of those tokens.
        ``checkpoints``: prompt positions where the prefix cache keeps a window of SWA KV (the
        caller's boundaries, e.g. media and message ends; ``Request.checkpoints``), at most
        ``prefix_checkpoints_per_request`` of them kept (``cap_checkpoints``). ``priority``: lower
        is served first under the ``priority`` queue policy (``check_priority``). ``cache_salt``:
        the request shares prefix-cache KV (every tier) only with requests of the same salt
        (llm_core/kvcache/page_keys.py)."""
        req, problem = self.admission.admit(str(request_id), prompt_token_ids, params, next(self._arrivals),
                                            embeds=embeds, extra_keys=extra_keys, checkpoints=checkpoints,
                                            priority=priority, cache_salt=cache_salt)
        with self._lock:
            if req.request_id in self._live:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            if problem is not None:
                req.status, req.finish_reason = req.status.FINISHED, "error"
                req.error, req.error_kind = problem.message, problem.kind
                out = self._output(req, [])
                out.text = req.final_text(self.tokenizer)  # "" (no output) with a tokenizer: no decode runs
                self._early_outputs.append(out)
                return
            self._live[req.request_id] = req
            self._pending_add.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its final output (finish_reason "abort") comes from step()."""
        with self._lock:
            self._pending_abort.append(str(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live or self._early_outputs or self._pending_abort)

    def has_ready_work(self) -> bool:
        """Whether step() now has something to do: outputs to hand over (a prompt rejected at
        add_request), requests to admit or abort, or a request with tokens it may compute (its
        embeddings are ready past what is computed). False while every request waits for media: a
        driving loop then sleeps instead of spinning step(). Call it from the thread that calls
        step() (it reads the scheduler's queues)."""
        with self._lock:
            if self._early_outputs or self._pending_add or self._pending_abort:
                return True
        s = self.scheduler
        return any(r.schedulable_until() > r.num_computed_tokens for r in (*s.running, *s.waiting))

    def step(self) -> list[RequestOutput]:
        """Run one scheduled model step; returns outputs of requests that progressed or ended, and
        publishes a new stats snapshot before returning.

        ``last_step_progressed`` then says whether the step changed anything (admitted, ended,
        preempted or computed): a step with ready work may still schedule nothing when the pools are
        held by requests that wait for their media."""
        outputs = self._step()
        self.publish_stats(complete=not self.has_unfinished())
        return outputs

    def stats(self) -> EngineStats:
        """The last snapshot the engine thread published (any thread: it reads no engine state)."""
        return self._stats

    def publish_stats(self, complete: bool = True) -> EngineStats:
        """Build and publish a new snapshot; call on the thread that steps. ``complete=False``
        re-reads the prefix cache's stats only every PREFIX_STATS_INTERVAL_S."""
        now = time.monotonic()
        if complete or now - self._prefix_stats_at >= PREFIX_STATS_INTERVAL_S:
            self._prefix_stats, self._prefix_stats_at = self.prefix_cache.stats(), now
        self._stats = EngineStats.collect(self.pool, self.scheduler, self._prefix_stats, now,  # one swap
                                          max_model_len=self.max_model_len,
                                          speculative=None if self.speculative is None else self.speculative.stats,
                                          generation_tokens=self._generation_tokens)
        return self._stats

    @torch.inference_mode()  # schedule() copies KV pages to and from the host tier, not only the forward
    def _step(self) -> list[RequestOutput]:
        outputs, drained = self._drain_queues()
        batch = self.scheduler.schedule()
        self.last_step_progressed = drained or bool(batch) or bool(batch.failed) or bool(batch.preempted)
        for req in batch.failed:
            outputs.append(self._final_output(req, []))
        if not batch:
            return outputs
        self.runner.begin_step()
        result = run_isolated(self._stepper, batch.entries, lambda: self.prefix_cache.kv_buffers(self.pool))
        for e, exc in result.failed:  # only these end; the others go on as if they had run alone
            if isinstance(exc, NoTokenAllowed):  # the request's constraints exclude every token: its own doing
                self.scheduler.finish(e.request, "error", str(exc), ErrorKind.INVALID_INPUT)
            else:
                self.scheduler.finish(e.request, "error", f"{type(exc).__name__}: {exc}", ErrorKind.INTERNAL)
            outputs.append(self._final_output(e.request, []))
        for e, found in result.prompt_logprobs:  # before the outputs of the step are built
            if not e.request.finished:
                e.request.add_prompt_logprobs(found.first, found.logprobs, found.ranks, found.top)
        outputs.extend(self._hand_out(batch, result))
        return outputs

    def _failed_output(self, req: Request, exc: Exception) -> RequestOutput:
        """End ``req`` with an internal error raised while its step's token or its final text was
        handed out. Its text is "" (not decoded again: the tokenizer may be what failed); a request
        that already ended in error keeps that error (the client learns why it really ended)."""
        log.exception("request %s failed after its step", req.request_id)
        self.scheduler.finish(req, "error")  # pages back (a no-op when its stop already ended it)
        if req.finish_reason != "error":
            req.finish_reason, req.error = "error", f"{type(exc).__name__}: {exc}"
            req.error_kind = ErrorKind.INTERNAL
        with self._lock:
            self._live.pop(req.request_id, None)
        out = self._output(req, [])
        out.text = None if self.tokenizer is None else ""
        return out

    def probe_prefill(self, num_tokens: int) -> bool:
        """A scratch prefill of ``num_tokens`` tokens (pages given back; no request, queue, prefix cache or
        counter touched; under MTP the MTP layers' KV too, as in a prompt chunk) to time thread counts
        on the stepping thread. False (nothing ran): no pages to spare, or the model spans ranks."""
        if num_tokens < 1:
            raise ValueError(f"probe_prefill needs num_tokens >= 1, got {num_tokens}")
        if self.config.world_size > 1:
            return False
        return scratch_prefill(self._stepper, self.pool, min(num_tokens, self.max_model_len - 1),
                               self.config.page_size, self.model_config.vocab_size)

    def check_health(self) -> None:
        """Raise RankFailure when a rank of a tensor/expert-parallel model is gone (no-op otherwise)."""
        check = getattr(self.runner.model, "check_health", None)
        if check is not None:
            check()

    def close(self) -> None:
        """Stop background work of the prefix-cache tiers (pending L3 writes are finished first) and
        the other ranks of a parallel model."""
        self.prefix_cache.close()
        if self.grammars is not None:
            self.grammars.close()
        closer = getattr(self.runner.model, "close", None)
        if closer is not None:
            closer()

    # ---- internal helpers -------------------------------------------------------------------
    def _hand_out(self, batch, result: StepResult) -> list[RequestOutput]:
        """A step's tokens, plain or speculative alike: an entry brings 1 token (a verify entry
        1..k+1), appended in order with the stop checks after each (a stop drops the rest); then the
        scheduler learns how far each entry really computed (a verify entry's rejected KV is rolled
        back in both pools before the prefix cache and the SWA release see the request), and only
        then are stops finished and outputs built. An exception while a token is appended or
        checked, or while a final text is decoded, ends that request only."""
        by_entry: dict[int, list] = {}
        for s in result.sampled:
            by_entry.setdefault(id(s.entry), []).append(s)
        ends: dict[int, int] = {}
        done: list[tuple[Request, list[int], str | None]] = []
        outputs: list[RequestOutput] = []
        for e in batch.entries:
            req, toks = e.request, by_entry.get(id(e))
            if req.finished or not toks:
                continue
            new: list[int] = []
            reason = None
            try:
                for s in toks:
                    req.append_token(s.token_id, s.logprob, s.top_logprobs)
                    new.append(s.token_id)
                    reason = req.check_stop(self.max_context_tokens)
                    if reason is not None:
                        break
            except Exception as exc:  # noqa: BLE001 -- ends this request only (after_step skips it)
                outputs.append(self._failed_output(req, exc))
                continue
            if e.num_draft_tokens:
                ends[id(e)] = e.start + len(new)  # the target verified every token it emits but the last
            done.append((req, new, reason))
        self.scheduler.after_step(batch, ends)
        for req, new, reason in done:
            try:
                if reason is not None:
                    self.scheduler.finish(req, reason)
                    outputs.append(self._finish_output(req, new))
                else:
                    outputs.append(self._output(req, new))
            except Exception as exc:  # noqa: BLE001 -- the final text's decode: this request only
                outputs.append(self._failed_output(req, exc))
        return outputs

    def _drain_queues(self) -> tuple[list[RequestOutput], bool]:
        """(outputs of early rejections and aborts, whether anything was queued)."""
        with self._lock:
            outputs, self._early_outputs = self._early_outputs, []
            adds, self._pending_add = self._pending_add, []
            aborts, self._pending_abort = self._pending_abort, []
        drained = bool(outputs or adds or aborts)
        for req in adds:
            self.scheduler.add(req)
        for rid in aborts:
            with self._lock:
                req = self._live.get(rid)
            if req is not None and not req.finished:
                self.scheduler.finish(req, "abort")
                outputs.append(self._final_output(req, []))
        return outputs, drained

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        self._generation_tokens += len(new)  # every token handed out passes here (speculative too)
        return req.output(new, self.scheduler.cached_prompt_tokens(req))

    def _finish_output(self, req: Request, new: list[int]) -> RequestOutput:
        """A finished request's last output, with its final text (the decode may raise)."""
        with self._lock:
            self._live.pop(req.request_id, None)
        out = self._output(req, new)
        out.text = req.final_text(self.tokenizer)
        return out

    def _final_output(self, req: Request, new: list[int]) -> RequestOutput:
        """``_finish_output`` where nothing else guards it (aborts, scheduler failures, failed
        entries): a decode that raises ends this request with "error", and the step's other outputs
        are still handed out (a lost output leaves its client waiting for ever)."""
        try:
            return self._finish_output(req, new)
        except Exception as exc:  # noqa: BLE001 -- this request only
            return self._failed_output(req, exc)
