"""Encoders on their own device: an EmbeddingStream given the LLM's device moves each unit's rows
there as they arrive (the encoder's copy is not held), so prefill reads rows already in place.
The ``meta`` device stands in for a second GPU on this CPU-only machine."""

from __future__ import annotations

import torch

from mm_pipeline.runtime.embedding_stream import EmbeddingStream, PlaceholderSpan


def test_rows_move_to_the_llm_device_on_arrival():
    spans = [PlaceholderSpan(1, 3, "a"), PlaceholderSpan(4, 6, "b")]
    stream = EmbeddingStream(8, spans, hidden_size=4, device=torch.device("meta"))
    stream.fill(0, torch.ones(2, 4))
    stream.fill(1, torch.ones(2, 4))
    assert stream.ready_until() == 8
    mask, rows = stream.rows(0, 8)
    assert rows.device.type == "meta" and tuple(rows.shape) == (4, 4)


def test_same_device_rows_are_kept_as_given():
    stream = EmbeddingStream(4, [PlaceholderSpan(0, 2, "a")], hidden_size=3, device=torch.device("cpu"))
    rows = torch.randn(2, 3)
    stream.fill(0, rows)
    got = stream.rows(0, 2)[1]
    assert got.device == rows.device and torch.equal(got, rows)
