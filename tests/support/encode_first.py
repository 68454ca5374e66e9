"""The encode-first reference of the omni engine tests: every media row computed up front, filled
into an EmbeddingStream, and the prompt run through a plain LLMEngine to the end. Streamed and
cached paths must give the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_core import EngineConfig, LLMEngine, SamplingParams
from mm_pipeline.runtime.embedding_stream import EmbeddingStream, PlaceholderSpan


def encode_first_tokens(text_model, prompt: Sequence[int], spans: list[PlaceholderSpan],
                        fills: Sequence[torch.Tensor], hidden_size: int, params: SamplingParams) -> list[int]:
    """Greedy tokens of ``prompt`` with ``fills[k]`` in ``spans[k]``, all present before prefill."""
    stream = EmbeddingStream(len(prompt), spans, hidden_size)
    for k, rows in enumerate(fills):
        stream.fill(k, rows)
    llm = LLMEngine(text_model, EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048))
    llm.add_request("ref", list(prompt), params, embeds=stream)
    while True:
        done = next((o for o in llm.step() if o.finished), None)
        if done is not None:
            return done.token_ids
