"""ModelRunner: one scheduled batch through the model -- input preparation, forward, sampling.

    ScheduledBatch ─► build_forward_batch (flat ids, positions, slot maps, page tables)
                   ─► splice_embeds (placeholder rows of requests with an EmbeddingSource)
                   ─► model forward over the KV buffers ─► logits of the sampling rows only
                   ─► Sampler ─► one SampledToken per entry that reached its request's last token

The runner knows tensors and the model, nothing of a request's lifecycle (queues, stop checks,
outputs: llm_core/engine/llm_engine.py). It catches nothing: a failing forward raises to the
engine, which ends that batch's requests with the error and keeps serving the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_core.engine.batch_builder import build_forward_batch, splice_embeds
from llm_core.engine.sampling import Sampler
from llm_core.engine.scheduler import ScheduledBatch, ScheduledRequest


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one entry of a batch, with its logprob and top-n map when requested."""

    entry: ScheduledRequest
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


class ModelRunner:
    """Owns the model and the sampler; turns a :class:`ScheduledBatch` into sampled tokens."""

    def __init__(self, model: torch.nn.Module, page_size: int, seed: int = 0) -> None:
        self.model = model
        self.page_size = page_size
        self.device = next(model.parameters()).device
        self.dtype = model.model.norm.weight.dtype  # the KV pools take the activations' dtype
        self.sampler = Sampler(seed, self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, kv) -> list[SampledToken]:
        """Compute the batch's new tokens into ``kv`` (the pool, or a prefix-cache view that waits for
        tier loads per layer) and sample the next token of every entry that ``samples``."""
        fb, input_ids = build_forward_batch(batch.entries, self.page_size, self.device)
        embeds = splice_embeds(batch.entries, input_ids, self.model.embed)
        if embeds is None:
            hidden = self.model(input_ids, fb, kv)
        else:
            hidden = self.model(None, fb, kv, inputs_embeds=embeds)
        sampling = [e for e in batch.entries if e.samples]
        if not sampling:
            return []  # prefill chunks that stop short of the prompt's end: nothing to sample
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        out = self.sampler(logits, [e.request.params for e in sampling], [e.request.generator for e in sampling])
        return [SampledToken(e, tok, lp, top)
                for e, tok, lp, top in zip(sampling, out.token_ids, out.logprobs, out.top_logprobs)]
