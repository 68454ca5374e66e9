"""ModelRunner: one scheduled batch through the model -- input preparation, forward, sampling.

    ScheduledBatch ─► build_forward_batch (flat ids, positions, slot maps, page tables)
                   ─► splice_embeds (placeholder rows of requests with an EmbeddingSource)
                   ─► model forward over the KV buffers (its last layer past the KV store for the
                      sampling rows only: ForwardBatch.logits_only) ─► logits of the sampling rows
                   ─► Sampler ─► one SampledToken per entry that reached its request's last token

When every sampling row is greedy without logprobs (``Sampler.argmax_suffices``), the model gives the
ids straight from its LM head (``greedy_ids``: no logits written) where it can; the logits and the
sampler serve every other step.

A decode-only batch of at most the largest bucket takes the fixed-shape path instead when it is
enabled (``enable_decode_graphs``: persistent batch rows, torch.compile or CUDA graphs per bucket,
llm_core/engine/fixed_decode/decode_graphs.py); its logits are the same rows in the same order.

The runner knows tensors and the model, nothing of a request's lifecycle (queues, stop checks,
outputs: llm_core/engine/llm_engine.py). Sampling is isolated per row: a row that cannot be sampled
comes back in ``StepResult.failed`` and the others are sampled as if it were not there. A failing
input preparation or forward raises to the engine, which finds the entries that fail on their own
(``forward`` of each alone) and runs the others again without them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kernels.cpu import huge_pages as huge_page_memory
from llm_core.distributed.rank_failure import RankFailure
from llm_core.engine.batch_builder import build_forward_batch, splice_embeds
from llm_core.engine.decode_batch_state import DecodeBatchState
from llm_core.engine.fixed_decode.decode_graphs import DecodeGraphs
from llm_core.engine.sampling.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs, wanted_rows, wants_prompt_rows
from llm_core.engine.request import Request
from llm_core.engine.sampling import Sampler, SamplingParams
from llm_core.engine.scheduled_batch import ScheduledRequest


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one entry of a batch, with its logprob and top-n map when requested."""

    entry: ScheduledRequest
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


@dataclass(frozen=True)
class StepResult:
    """A step's sampled tokens, the entries whose own sampling failed (with the error), and the
    prompt logprobs its prefill rows gave the requests that asked for them (sampling/prompt_logprobs.py)."""

    sampled: list[SampledToken]
    failed: list[tuple[ScheduledRequest, Exception]]
    prompt_logprobs: list[tuple[ScheduledRequest, PromptLogprobs]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the sampler; turns a batch's entries into sampled tokens."""

    def __init__(self, model: torch.nn.Module, page_size: int, seed: int = 0, huge_pages: bool = False,
                 persistent_decode_batch: bool = False) -> None:
        """``huge_pages``: move the CPU weights onto huge-page-advised memory once laid out
        (kernels/cpu/huge_pages.py: a decode step streams them from memory; same values and strides).
        ``persistent_decode_batch``: a decode step of last step's requests advances last step's
        inputs instead of rebuilding them (decode_batch_state.py; the same tensors)."""
        self.model = model
        self.page_size = page_size
        self.device = next(model.parameters()).device
        self.dtype = model.model.norm.weight.dtype  # the KV pools take the activations' dtype
        self.sampler = Sampler(seed, self.device)
        prepare = getattr(model, "prepare_weights_", None)
        if prepare is not None:  # a MirroredModel: every rank prepares its shard so, with this rank's settings
            prepare(huge_pages)
        else:
            model.use_kernel_layouts_()  # expert stacks and linear weights as the device's GEMMs stream them
            if huge_pages:
                huge_page_memory.move_module_(model)  # after the re-layout: its copies are what the kernels read
        self.decode_graphs: DecodeGraphs | None = None
        self.decode_state = DecodeBatchState(page_size) if persistent_decode_batch else None
        self.steps = 0  # engine steps begun (the decode state advances only from the previous one)
        # True: the model's output holds every row's final hidden state (a forward hook recording
        # them, e.g. MTP training data); False: its last layer runs the sampling rows only.
        self.every_row_hidden = False
        # called with a step's row count before its forward: the owner's per-step settings (CPU:
        # its intra-op threads, e.g. the whole team only for a long step on free cores)
        self.before_step: Callable[[int], None] | None = None

    def enable_decode_graphs(self, pool, *, buckets: tuple[int, ...], mode: str, max_model_len: int) -> float:
        """Run decode-only steps as fixed-shape steps per batch bucket over ``pool`` (takes one
        scratch page of each of its pools); compiles / captures every bucket now and returns the
        seconds that took. A tensor/expert-parallel model builds them on every rank
        (``MirroredModel.mirrored_decode_graphs``)."""
        mirrored = getattr(self.model, "mirrored_decode_graphs", None)
        if mirrored is not None:
            t0 = time.perf_counter()
            self.decode_graphs = mirrored(pool, buckets=buckets, mode=mode, max_model_len=max_model_len)
            return time.perf_counter() - t0
        self.decode_graphs = DecodeGraphs(self.model, pool, buckets=buckets, mode=mode, max_model_len=max_model_len)
        return self.decode_graphs.warm_up(pool)

    def begin_step(self) -> None:
        """Called by the engine once per step (the persistent batch tells kept rows from stale ones)."""
        self.steps += 1
        if self.decode_graphs is not None:
            self.decode_graphs.note_step()

    @torch.inference_mode()
    def run(self, entries: list[ScheduledRequest], kv) -> StepResult:
        """Compute the entries' new tokens into ``kv`` (the pool, or a prefix-cache view that waits
        for tier loads per layer) and sample the next token of every entry that ``samples``."""
        if self.before_step is not None:
            self.before_step(sum(e.num_new_tokens for e in entries))
        sampling = [e for e in entries if e.samples]
        params = [e.request.params for e in sampling]
        prompt: list[tuple[ScheduledRequest, PromptLogprobs]] = []
        if wants_prompt_rows(entries):
            # prompt logprobs: the last layer runs every row, whose logits give them (a block at a time)
            fb, hidden = self._hidden(entries, kv, every_row=True)
            wanted = wanted_rows(entries, fb.query_start_loc.tolist())
            found = compute_prompt_logprobs(lambda a, b: self.model.compute_logits_rows(hidden, a, b), wanted)
            prompt = [(e, found[id(e)]) for e, *_ in wanted]
            logits = self.model.compute_logits(fb.logits_hidden(hidden)) if sampling else None
        elif sampling and Sampler.argmax_suffices(params) and not self._fixed_shape(entries):
            # greedy without logprobs: the ids straight from the LM head when the model can (no logits)
            hidden = self._sampling_hidden(entries, kv)
            ids = self.model.greedy_ids(hidden)
            if ids is not None:
                return StepResult([SampledToken(e, tok, None, None) for e, tok in zip(sampling, ids)], [])
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.forward(entries, kv)
        if not sampling:
            return StepResult([], [], prompt)  # prefill chunks that stop short of the prompt's end
        out, failed = self.sampler.sample_isolated(logits, params, [e.request.generator for e in sampling],
                                                   [e.request for e in sampling])
        return StepResult([SampledToken(e, tok, lp, top) for i, (e, tok, lp, top)
                           in enumerate(zip(sampling, out.token_ids, out.logprobs, out.top_logprobs))
                           if i not in failed],
                          [(sampling[i], exc) for i, exc in failed.items()], prompt)

    @torch.inference_mode()
    def forward(self, entries: list[ScheduledRequest], kv) -> torch.Tensor:
        """Input preparation and forward of ``entries``: the logits of their sampling rows [S, V].
        Draws no random numbers, so the engine may run it to probe which entry makes a step fail."""
        if self._fixed_shape(entries):
            logits = self.decode_graphs.forward(entries, kv)
            if all(e.samples for e in entries):
                return logits
            return logits[[i for i, e in enumerate(entries) if e.samples]]
        return self.model.compute_logits(self._sampling_hidden(entries, kv))

    # ---- internal helpers -------------------------------------------------------------------
    def _fixed_shape(self, entries: list[ScheduledRequest]) -> bool:
        """Whether the fixed-shape decode path (compiled / captured buckets) takes these entries."""
        return self.decode_graphs is not None and self.decode_graphs.supports(entries)

    def _sampling_hidden(self, entries: list[ScheduledRequest], kv) -> torch.Tensor:
        """Input preparation and the model's layers: the final-normed hidden rows of the sampling
        entries [S, hidden], the LM head's input."""
        fb, hidden = self._hidden(entries, kv, every_row=self.every_row_hidden)
        return fb.logits_hidden(hidden)

    def _hidden(self, entries: list[ScheduledRequest], kv, every_row: bool):
        """(ForwardBatch, the model's final-normed output): every row's hidden state with
        ``every_row``, else the sampling rows' alone where the model can skip the others."""
        # logits_only: the last layer runs the sampling rows alone (a prompt chunk's one row of T)
        if self.decode_state is not None:
            fb, input_ids = self.decode_state.build(entries, self.device, self.steps, logits_only=not every_row)
        else:
            fb, input_ids = build_forward_batch(entries, self.page_size, self.device, logits_only=not every_row)
        embeds = splice_embeds(entries, input_ids, self.model.embed)
        if embeds is None:
            hidden = self.model(input_ids, fb, kv)
        else:
            hidden = self.model(None, fb, kv, inputs_embeds=embeds)
        return fb, hidden


def run_isolated(stepper, entries: list[ScheduledRequest], kv_buffers: Callable[[], Any]) -> StepResult:
    """Run the step on ``stepper`` (a ModelRunner, or the speculative runner over it) over the KV
    ``kv_buffers()`` gives so that one request's exception fails only that request.

    When the step itself raises (input preparation or forward), each entry's forward is run on
    its own (no sampling, so no random draw is spent) to find those that fail alone; the step is
    then run again without them, which recomputes the same KV into the same slots. When no entry
    fails alone the fault is not any request's (a device error): the whole batch ends with it --
    as when the KV cannot be had at all (a prefix reload from a slower tier that already failed:
    no entry may run on pages whose KV never landed)."""
    try:
        kv = kv_buffers()
    except RankFailure:
        raise  # as below: the engine cannot go on
    except Exception as exc:  # noqa: BLE001 -- no KV to run any entry on, alone or not
        return StepResult([], [(e, exc) for e in entries])
    try:
        return stepper.run(entries, kv)
    except RankFailure:
        raise  # a parallel rank is gone: no request's fault, the engine cannot go on
    except Exception as exc:  # noqa: BLE001 -- attributed below
        first = exc
    failed: list[tuple[ScheduledRequest, Exception]] = []
    if len(entries) > 1:
        for e in entries:
            try:
                stepper.forward([e], kv)
            except RankFailure:
                raise  # a rank went during the probes: still no request's fault
            except Exception as exc:  # noqa: BLE001 -- this entry's own failure
                failed.append((e, exc))
    if not failed:
        return StepResult([], [(e, first) for e in entries])
    culprits = {id(e) for e, _ in failed}
    rest = [e for e in entries if id(e) not in culprits]
    if not rest:
        return StepResult([], failed)
    try:
        result = stepper.run(rest, kv)
    except RankFailure:
        raise
    except Exception as exc:  # noqa: BLE001 -- the others fail together: not one request's fault
        return StepResult([], failed + [(e, exc) for e in rest])
    return StepResult(result.sampled, failed + result.failed)


def scratch_prefill(stepper, pool, num_tokens: int, page_size: int, vocab_size: int) -> bool:
    """One prefill of ``num_tokens`` made-up tokens through ``stepper`` on pages borrowed from
    ``pool`` and given back (``LLMEngine.probe_prefill``: thread counts are timed on it); the pools'
    peak use is left as it was. False (nothing ran) when the pools cannot spare the pages."""
    pages = -(-num_tokens // page_size)
    if pages > pool.full.num_free or (pool.has_swa and pages > pool.swa.num_free):
        return False
    # distinct, non-trivial ids (a constant prompt could take shortcuts no real prompt takes)
    ids = [(7 + 31 * i) % vocab_size for i in range(num_tokens)]
    req = Request("probe", ids, SamplingParams(max_tokens=1, temperature=0.0), -1)
    peaks = pool.full.peak_used, pool.swa.peak_used
    req.full_pages = pool.full.allocate(pages)
    req.swa_pages = pool.swa.allocate(pages) if pool.has_swa else [-1] * pages
    try:
        stepper.forward([ScheduledRequest(req, 0, num_tokens)], pool)
    finally:
        pool.full.free(req.full_pages)
        pool.swa.free(req.swa_pages)
        pool.full.peak_used, pool.swa.peak_used = peaks  # a probe is no use of the pools
    return True
