"""OmniRuntime: the parts behind an OmniEngine, wired once.

    OmniModel (text model, vision tower, audio encoder, tokenizer, prompt layout)
    LLMEngine ◄── EngineLoop (thread)    EncoderWorker (thread) ──► EncoderBatcher ──on_encoded──►
                                                                    EncoderCache tiers
              (encoder_worker=False: the EngineLoop runs the EncoderBatcher between steps)
    WorkerPool ◄── MediaIngestor, MediaPlanner (decode, preprocess, plan units)

``prepare_chat`` turns a parsed chat into token ids with placeholder spans sized before any
encoding (``ChatPreparation``, chat_preparation.py). Everything that blocks runs on the worker
pools; this object is used from the event loop.
OmniEngine asks it by intent (prepare_chat / tokenize / open_media / submit / abort / detach) and
never reaches into the parts.

Loaded ``encoders_only`` (an encoder replica) there is no text model and no LLMEngine (``llm`` is
None): the engine thread runs only encoder batches, and prepare_chat / open_media fill the encoder
cache exactly as with the whole model (same planner, preprocessing, towers and content keys).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Callable

import torch

from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.engine_config import context_limit
from llm_core.engine.llm_engine import LLMEngine
from llm_core.engine.sampling import SamplingParams
from llm_core.engine.structured.compiler import GrammarBusyError, GrammarError
from llm_core.engine.structured.params import StructuredOutputsParams
from mm_pipeline.prompt.messages import ChatRequest
from mm_pipeline.runtime.chat_preparation import ChatPreparation, PreparedChat, check_context
from mm_pipeline.runtime.embedding_stream import EmbeddingStream
from mm_pipeline.encode.batcher import EncoderBatcher
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.runtime.encoder_worker import EncoderWorker, default_threads, free_cpu_threads
from mm_pipeline.runtime.cpu_threads.host_cpu import HostCpu
from mm_pipeline.runtime.cpu_threads.intra_op import set_local_threads, set_process_default
from mm_pipeline.runtime.cpu_threads.thread_report import describe_threads, thread_counts
from mm_pipeline.runtime.cpu_threads.thread_choice import (WARM_UP_MAX_ROWS, WIDE_MIN_ROWS, StepThreads, llm_probe,
                                                          plan_threads, run_on_thread)
from mm_pipeline.runtime.engine_loop import EngineLoop, OutputSink
from mm_pipeline.errors import InvalidInputError, OverloadedError
from mm_pipeline.media.decode.backend import make_decode_backend
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.encode.planner import MediaPlanner
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.media_feed import MediaFeed
from mm_pipeline.runtime.timeline import StageTimeline
from mm_pipeline.runtime.warm_start import freeze_startup_objects, import_request_path_modules
from mm_pipeline.model.config import OmniConfig
from mm_pipeline.model.omni_model import OmniModel
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.media.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class OmniRuntime:
    def __init__(self, model: OmniModel, config: OmniEngineConfig,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        config.check_checkpoint(model.image_config.temporal_patch_size)  # before anything is allocated
        self.model = model
        self.config = config
        # the sampling of a request that leaves a field unset (--generation-config; OmniRuntime.load
        # reads the checkpoint's generation_config.json): applied where requests are built (server, jobs)
        self.generation_defaults = generation_defaults or GenerationDefaults.load(
            None, "none", config.engine.override_generation_config)
        self.llm = LLMEngine(model.text, config.engine, tokenizer=model.tokenizer) if model.text is not None else None
        # the context limit media budgets are checked against: the engine's, capped at its Full pool
        # (a chat over it fails here, before its media is decoded); without an LLM the configured or
        # model limit
        self.max_model_len = (self.llm.max_context_tokens if self.llm is not None
                              else context_limit(config.engine.max_model_len, model.text_config.max_position_embeddings))
        self.cache = EncoderCache.tiered(config.cache_memory_bytes, config.cache_dir, config.cache_disk_bytes,
                                         config.redis_url)
        self.batcher = EncoderBatcher(model.vision, model.audio, config.batcher_config, on_encoded=self.cache.put)
        self.encoder_worker: EncoderWorker | None = None
        # requests take turns, and a spare thread starts a request's media calls at once while
        # another request's video holds every decode worker (media/worker_pool.py)
        self.pool = WorkerPool(config.decode_workers, config.decode_queue, config.decode_admit_timeout_s,
                               name="omni-media", spare=config.decode_spare_workers)
        llm_threads, encoder_threads, self.probes = plan_threads(
            config.llm_threads, config.encoder_threads, self.llm, model.vision if config.encoder_worker else None,
            model.encoder_device, self.pool)
        pool = self.pool
        decoding = lambda: pool.busy  # noqa: E731  (decode workers using a CPU: not those waiting on the budget)
        if config.encoder_worker:
            # lanes beyond the first wait while the decode workers fill the CPUs
            spare = free_cpu_threads(default_threads(), decoding)
            self.encoder_worker = EncoderWorker(self.batcher, model.encoder_device, threads=encoder_threads,
                                                lanes=config.encoder_lanes, spare=spare)
            if self.encoder_worker.device.type == "cuda":
                self.batcher.before_deliver = self.encoder_worker.deliver_ready
            self.batcher.on_submit = self.encoder_worker.wake
        cpu_llm = self.llm is not None and self.llm.device.type == "cpu"
        worker = self.encoder_worker
        step_threads = None
        if cpu_llm and config.llm_threads == "auto":  # the team only for long steps on free cores
            measured = config.llm_team_min_rows == "auto"
            llm = self.llm
            step_threads = StepThreads(default_threads(), lambda: decoding() + (worker.busy_lanes if worker else 0),
                                       HostCpu(), min_rows=WIDE_MIN_ROWS if measured else config.llm_team_min_rows,
                                       short_probe=(lambda rows: llm_probe(llm, rows)) if measured else None)
        self.loop = EngineLoop(self.llm, None if worker is not None else self.batcher, threads=llm_threads,
                               step_threads=step_threads,
                               warm_up_rows=min(config.engine.max_num_batched_tokens, WARM_UP_MAX_ROWS)
                               if cpu_llm and config.warm_up else 0)
        if worker is None:
            self.batcher.on_submit = self.loop.wake
        # text tokenization never queues behind media decodes (a slow or hostile file must not
        # stall text-only requests); its work is bounded by the context limit (TextBound)
        self.text_pool = WorkerPool(2, config.max_queue, config.decode_admit_timeout_s, name="omni-text")
        # structured-output grammars compile on their own thread (the engine's compiler runs one at a
        # time, each bounded by grammar_compile_timeout_s): a hostile schema never holds tokenization
        self.grammar_pool = WorkerPool(1, config.max_queue, config.decode_admit_timeout_s, name="omni-grammar")
        self.decoder = make_decode_backend(config.decode_backend, config.decode_workers)
        self.ingestor = MediaIngestor(config.ingest_config, self.pool)
        self.pre = Preprocessor(model.image_config, model.audio_config, model.encoder_device, model.audio_codebooks)
        self.planner = MediaPlanner(self.pre, self.cache, self.batcher, self.pool, self.ingestor, model.encoder_id,
                                    config.planner_config(model.video_sampling, self.max_model_len,
                                                         default_video_audio=model.video_audio),
                                    self.decoder)
        self.preparation = ChatPreparation(model.layout, self.planner, self.pool, self.text_pool, self.max_model_len)
        self._started = False
        self._closed = False

    def thread_counts(self) -> dict[str, int]:
        """The intra-op threads the engine thread and the encoder worker run at (those that set one)."""
        return thread_counts(self.loop, self.encoder_worker)

    @classmethod
    def load(cls, model_dir: str | Path, config: OmniEngineConfig, *, encoders_only: bool = False) -> "OmniRuntime":
        """``encoders_only``: no text model is loaded (module doc)."""
        e = config.engine
        # on a thread of its own: the OpenMP team its torch ops start ends with it (thread_choice.py);
        # at the caller's intra-op count, which the runtime plans its threads from (default_threads)
        threads = torch.get_num_threads()
        if (Path(model_dir) / "config.json").is_file():  # else OmniModel.load says what is missing
            # the settings against the checkpoint's config before minutes of weight loading
            config.check_checkpoint(OmniConfig.from_pretrained(model_dir).image_processing.temporal_patch_size)
        # a bad generation config is a start-up error, before minutes of weight loading
        defaults = GenerationDefaults.load(model_dir, e.generation_config, e.override_generation_config)

        def build() -> OmniRuntime:
            set_local_threads(threads)
            model = OmniModel.load(model_dir, device=config.device, dtype=config.dtype,
                                   tensor_parallel_size=e.tensor_parallel_size,
                                   expert_parallel_size=e.expert_parallel_size,
                                   distributed_timeout_s=e.distributed_timeout_s, fp8_experts=e.fp8_experts,
                                   load_mtp=e.loads_mtp,
                                   encoder_device=config.encoder_device,
                                   audio_tokenizer_attention=config.audio_tokenizer_attention,
                                   with_text=not encoders_only, chat_template=config.chat_template,
                                   with_vision=config.needs_vision, with_audio=config.needs_audio)
            return cls(model, config, defaults)
        return run_on_thread(build, "omni-load")

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    # ---- requests ---------------------------------------------------------------------------
    async def prepare_chat(self, chat: ChatRequest, truncate: bool = False, salt: str | None = None, *,
                           layout_only: bool = False) -> PreparedChat:
        """Ingest and plan every media item, then lay the prompt out (``ChatPreparation.prepare``;
        ``layout_only``: for its token ids alone, no cached rows read)."""
        return await self.preparation.prepare(chat, truncate, salt, layout_only=layout_only)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a request's structured output constraint before it is admitted (cached; off the
        event loop): an ``InvalidInputError`` (a 400) naming what is wrong with it."""
        if self.llm is None:
            raise InvalidInputError("an encoders-only runtime generates no text to constrain")
        try:
            await self.grammar_pool.run(self.llm.compile_grammar, params)
        except GrammarBusyError as exc:  # other constraints held the compiler: the client may retry
            raise OverloadedError(str(exc)) from None
        except GrammarError as exc:  # param: the request field the constraint came from, when known
            where = () if params.source is None else tuple(int(p) if p.isdigit() else p for p in params.source.split("."))
            raise InvalidInputError(str(exc), loc=where) from None

    async def tokenize(self, text: str, add_special_tokens: bool = False, keep_last: int | None = None) -> list[int]:
        """Token ids of a plain text prompt (no chat template), on the worker pool. A prompt is
        served as its text's tokens alone; ``add_special_tokens`` (``POST /tokenize``'s field) adds
        what the tokenizer adds around a text (a BOS, for tokenizers that have one). ``keep_last``
        (``truncate_prompt_tokens``; -1: what the context holds with room for one token): only
        the text's last tokens, so a text longer than the context is cut rather than refused."""
        return await self.text_pool.run(self._encode_text, text, add_special_tokens, keep_last)

    def open_media(self, prepared: PreparedChat, request_id: str,
                   on_progress: Callable[[], None] | None = None) -> MediaFeed:
        """The EmbeddingStream over ``prepared``'s placeholders and the unit sinks that fill it (not
        started). Every arrival or failure wakes the engine thread, then calls ``on_progress``; a
        failed unit aborts ``request_id``."""
        def progressed() -> None:
            self.loop.wake()
            if on_progress is not None:
                on_progress()

        stream = EmbeddingStream(len(prepared.token_ids), prepared.spans, self.hidden_size, on_progress=progressed,
                                 device=self.llm.device if self.llm is not None else self.model.device,
                                 min_advance=self.config.stream_min_tokens, encoder_busy=self.batcher.has_pending)
        return MediaFeed(stream, prepared.plans, prepared.spans_of_plan, self.planner,
                         lambda: self.loop.abort(request_id), prepared.parts)

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
               stream: EmbeddingStream | None, on_output: OutputSink, checkpoints: tuple[int, ...] = (),
               priority: int = 0, cache_salt: str | None = None) -> None:
        """Hand a request to the engine thread; each of its outputs goes to ``on_output`` (called on
        that thread). The stream's media hashes are mixed into the prefix-cache keys of their
        placeholder ranges: equal placeholder ids with other media never match. ``checkpoints``:
        where the prefix cache keeps a window (``PreparedChat.checkpoints``); ``priority``,
        ``cache_salt``: as ``LLMEngine.add_request`` takes them."""
        if stream is not None and not stream.spans:
            stream = None  # a chat without media is plain token ids; as such the prefix cache can match it
        extra_keys = () if stream is None else stream.extra_keys()
        self.loop.add_request(request_id, token_ids, params, stream, on_output, extra_keys=extra_keys,
                              checkpoints=checkpoints, priority=priority, cache_salt=cache_salt)

    def abort(self, request_id: str) -> None:
        """End a request; its final output (finish_reason "abort") still reaches its sink."""
        self.loop.abort(request_id)

    def detach(self, request_id: str) -> None:
        """Stop delivering a request's outputs (its consumer is gone)."""
        self.loop.detach(request_id)

    def _encode_text(self, text: str, add_special_tokens: bool = False, keep_last: int | None = None) -> list[int]:
        keep = None if keep_last is None else self.max_model_len - 1 if keep_last == -1 else keep_last
        if keep is None:
            self.model.layout.text_bound.check([text], self.max_model_len)
        else:  # its first tokens may differ from the whole text's (they are dropped), the rest are the same
            text = self.model.layout.text_bound.tail(text, keep + 8)
        ids = list(self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = ids if keep is None else ids[-keep:]
        check_context(len(ids), self.max_model_len)
        return ids

    def record_timeline(self) -> StageTimeline:
        """Start recording when each stage runs (video decode chunks, encoder forwards, LLM steps)
        and return the timeline (benchmarks/pipeline.py prints one request's)."""
        timeline = StageTimeline()
        self.planner.producer.on_decode_span = lambda a, b: timeline.add("decode", a, b)
        self.batcher.on_forward_span = lambda a, b: timeline.add("encode", a, b)
        self.loop.on_step_span = lambda a, b: timeline.add("prefill", a, b)
        return timeline

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if not self._started:
            if self.loop.step_threads is not None:
                # the engine thread owns the one wide team: every thread that sets no count of its
                # own (this one, the event loop's, KV tier and cache writers) runs at one (intra_op.py)
                set_process_default(1)
            import_request_path_modules()
            freeze_startup_objects()
            if self.encoder_worker is not None:
                self.encoder_worker.start()
            self.loop.start()
            self._started = True
            self._await_thread_choices()

    def _await_thread_choices(self, timeout_s: float = 30.0) -> None:
        """Wait for the engine thread's start-up work (warm-up step, thread probe) and the threads'
        probes, so no request races them for the CPU (or shows up in a forward hook), and log the counts."""
        if not self.loop.ready.wait(timeout_s):
            log.warning("the engine thread's start-up is still running after %.0f s", timeout_s)
        for probe in self.probes:
            if not probe.ready.wait(timeout_s):
                log.warning("the %s's thread probe is still running after %.0f s", probe.name, timeout_s)
        if self.probes:
            log.info("intra-op threads: %s", self.describe_threads())

    def describe_threads(self) -> str:
        """How the engine thread's and the encoder's intra-op threads were chosen (thread_report.py)."""
        return describe_threads(self.loop, self.encoder_worker, engine_cpu=self.llm is None or self.llm.device.type == "cpu")

    def shutdown(self) -> None:
        """Stop the engine thread (open requests end with "abort"), the workers and the cache
        writer; idempotent."""
        if self._closed:
            return
        self._closed = True
        # give frozen objects back to the collector: this runtime's reference cycles become garbage
        # now (a runtime started later freezes what is alive then, again)
        gc.unfreeze()
        if self.encoder_worker is not None:
            self.encoder_worker.stop()
        self.loop.stop()
        if self.llm is not None:
            self.llm.close()
        self.pool.shutdown(wait=False)
        self.decoder.shutdown()
        self.text_pool.shutdown(wait=False)
        self.grammar_pool.shutdown(wait=False)
        self.cache.close()
        for tier in self.cache.tiers:
            tier.close()
