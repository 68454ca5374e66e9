"""Embeddings streamed into chunked prefill (mm_pipeline.runtime.embedding_stream + llm_core engine).

Streaming only changes *when* the readiness frontier moves, never what is computed: greedy tokens
with units arriving late, in any order, equal those with every unit ready up front; the scheduler
never computes a placeholder before its unit arrives, and the text before it is prefilled early.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
from mm_pipeline.runtime.embedding_stream import EmbeddingStream, PlaceholderSpan

HIDDEN = 64  # tiny checkpoint hidden size
PAD = 500  # placeholder id (in vocabulary here, but its embedding must never be used)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def make_engine(model, chunk: int = 5) -> LLMEngine:
    return LLMEngine(model, EngineConfig(page_size=4, max_chunk_tokens=chunk, max_num_batched_tokens=12,
                                         num_full_tokens=1024, num_swa_tokens=512))


def layout(seed: int, n_units: int = 4) -> tuple[list[int], list[PlaceholderSpan], list[torch.Tensor]]:
    """text 6 | unit 7 | text 3 | unit 7 | ... ; random unit rows."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(3, 400, (6,), generator=g).tolist()
    spans, rows = [], []
    for k in range(n_units):
        n = 7 + k % 3
        spans.append(PlaceholderSpan(len(ids), len(ids) + n, f"unit-{seed}-{k}"))
        ids += [PAD] * n
        rows.append(torch.randn(n, HIDDEN, generator=g))
        ids += torch.randint(3, 400, (3,), generator=g).tolist()
    return ids, spans, rows


def find(engine: LLMEngine, rid: str):
    """The live request ``rid`` (None once finished)."""
    s = engine.scheduler
    return next((r for r in (*s.running, *s.waiting) if r.request_id == rid), None)


def run(engine: LLMEngine, ids, stream: EmbeddingStream, deliver, max_tokens=6):
    """Step the engine; ``deliver(step)`` fills units between steps. Returns tokens and a trace of
    (num_computed, frontier) after each step."""
    engine.add_request("r", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       embeds=stream)
    trace, final, step = [], None, 0
    while final is None:
        deliver(step)
        step += 1
        for out in engine.step():
            if out.finished:
                final = out
        req = find(engine, "r")
        if req is not None:
            trace.append((req.num_computed_tokens, stream.ready_until()))
        assert step < 500, "engine made no progress"
    assert final.finish_reason == "length", final.error
    return final.token_ids, trace


def test_streamed_equals_all_ready_and_never_passes_frontier(model):
    ids, spans, rows = layout(0)
    full = EmbeddingStream(len(ids), spans, HIDDEN)
    for k, r in enumerate(rows):
        full.fill(k, r)
    ref, _ = run(make_engine(model), ids, full, lambda step: None)

    streamed = EmbeddingStream(len(ids), spans, HIDDEN)
    arrive = {2: 0, 6: 1, 7: 3, 11: 2}  # unit 3 before unit 2: the frontier waits for 2

    def deliver(step):
        if step in arrive:
            streamed.fill(arrive[step], rows[arrive[step]])
        streamed.check_integrity()

    got, trace = run(make_engine(model), ids, streamed, deliver)
    assert got == ref
    assert all(computed <= frontier or frontier == len(ids) for computed, frontier in trace)
    # the text before the first unit was prefilled before that unit arrived (overlap)
    # (chunk 5: step 0 computes 5 tokens, step 1 the sixth; unit 0 arrives before step 2)
    assert [c for c, _ in trace[:2]] == [5, spans[0].start]


def test_min_advance_moves_the_frontier_in_larger_steps_and_keeps_the_tokens(model):
    """``min_advance``: the frontier the scheduler sees moves by at least that much (or to the end),
    so the engine steps fewer times while units trickle in; the tokens are the same."""
    ids, spans, rows = layout(2, n_units=6)
    arrive = {2 * k: k for k in range(len(rows))}
    results = {}
    for advance in (0, 20):
        stream = EmbeddingStream(len(ids), spans, HIDDEN, min_advance=advance)
        seen = []

        def deliver(step, stream=stream, seen=seen):
            if step in arrive:
                stream.fill(arrive[step], rows[arrive[step]])
            seen.append((stream.ready_until(), sum(spans[i].length for i in stream.missing())))

        engine = LLMEngine(model, EngineConfig(page_size=4, max_chunk_tokens=64, max_num_batched_tokens=64,
                                               num_full_tokens=1024, num_swa_tokens=512))
        results[advance] = run(engine, ids, stream, deliver), seen
    ((ref, ref_trace), _), ((got, trace), seen) = results[0], results[20]
    assert got == ref
    # a move is >= 20, or >= the rows still missing once fewer than 20 are (see the next test), or to the end
    moves = [(b, missing) for (a, _), (b, missing) in zip(seen, seen[1:]) if b != a]
    starts = [0, *(b for b, _ in moves)]
    assert all(b - a >= min(20, missing) or b == len(ids) for a, (b, missing) in zip(starts, moves))
    prefill_steps = lambda tr: len({c for c, _ in tr if c <= len(ids)})  # noqa: E731  (distinct progress)
    assert prefill_steps(trace) < prefill_steps(ref_trace)


def test_min_advance_drops_to_the_rows_still_missing():
    """Near the end of the media the bar is what is still missing, not ``min_advance``: rows held
    back then would all go into the step after the last unit, the one the first token waits for
    (unless encoder work is queued)."""
    spans = [PlaceholderSpan(2 + 10 * k, 12 + 10 * k, f"g{k}") for k in range(6)]  # [2, 12) ... [52, 62)
    rows = torch.zeros(10, HIDDEN)

    def reports(stream: EmbeddingStream) -> list[int]:
        return [stream.fill(k, rows) or stream.ready_until() for k in range(len(spans))]

    # missing after each unit: 50 40 30 20 10 0 rows; frontier 12 22 32 42 52 64 (the end)
    # bar min(25, missing): 25 25 25 20 10 -> moves at 32 (>= 25 past 0) and 52 (>= 10 past 32)
    assert reports(EmbeddingStream(64, spans, HIDDEN, min_advance=25)) == [0, 0, 32, 32, 52, 64]
    # the last step (after the last unit) computes 64 - 52 = 12 rows; a fixed bar of 25 would have
    # held 32 -> 52 back for it too (32 rows)
    assert reports(EmbeddingStream(64, spans, HIDDEN, min_advance=0)) == [12, 22, 32, 42, 52, 64]
    # encoder work queued: the encoder is what the first token waits for; the bar stays 25
    busy = EmbeddingStream(64, spans, HIDDEN, min_advance=25, encoder_busy=lambda: True)
    assert reports(busy) == [0, 0, 32, 32, 32, 64]


def test_unit_never_read_before_it_arrives(model):
    ids, spans, rows = layout(1, n_units=2)
    stream = EmbeddingStream(len(ids), spans, HIDDEN)
    engine = make_engine(model)
    engine.add_request("r", ids, SamplingParams(max_tokens=2, temperature=0.0), embeds=stream)
    for _ in range(6):  # the frontier sits at span 0: the request stalls there, nothing fails
        assert engine.step() == []
    assert find(engine, "r").num_computed_tokens == spans[0].start
    with pytest.raises(RuntimeError, match="before their unit"):
        stream.rows(spans[0].start, spans[0].end)
    stream.fill(0, rows[0])
    stream.fill(1, rows[1])
    outs = []
    while not any(o.finished for o in outs):
        outs += engine.step()
    assert outs[-1].finish_reason in ("stop", "length")


def test_placeholder_id_embedding_is_not_used(model):
    """Same rows, different placeholder ids -> same tokens (the rows replace the id embedding)."""
    ids, spans, rows = layout(2, n_units=2)
    outs = []
    for pad in (PAD, 7):
        pids = [pad if any(s.start <= i < s.end for s in spans) else t for i, t in enumerate(ids)]
        stream = EmbeddingStream(len(ids), spans, HIDDEN)
        for k, r in enumerate(rows):
            stream.fill(k, r)
        outs.append(run(make_engine(model), pids, stream, lambda step: None)[0])
    assert outs[0] == outs[1]


_REFS: dict[int, list[int]] = {}


@settings(max_examples=6, deadline=None)
@given(order=st.permutations([0, 1, 2]), gaps=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       chunk=st.sampled_from([3, 8]))
def test_any_arrival_order_and_chunking_gives_the_same_tokens(model, order, gaps, chunk):
    ids, spans, rows = layout(3, n_units=3)
    if chunk not in _REFS:  # all ready up front; computed once per chunk size
        full = EmbeddingStream(len(ids), spans, HIDDEN)
        for k, r in enumerate(rows):
            full.fill(k, r)
        _REFS[chunk] = run(make_engine(model, chunk=chunk), ids, full, lambda step: None, max_tokens=3)[0]
    ref = _REFS[chunk]
    stream = EmbeddingStream(len(ids), spans, HIDDEN)
    at, t = {}, 0
    for unit, gap in zip(order, gaps):
        t += gap
        at.setdefault(t, []).append(unit)

    def deliver(step):
        for unit in at.get(step, []):
            stream.fill(unit, rows[unit])

    got, trace = run(make_engine(model, chunk=chunk), ids, stream, deliver, max_tokens=3)
    assert got == ref
    assert all(c <= f or f == len(ids) for c, f in trace)


def test_stream_validation():
    spans = [PlaceholderSpan(2, 5, "a"), PlaceholderSpan(7, 9, "b")]
    s = EmbeddingStream(12, spans, 4)
    assert s.ready_until() == 2
    with pytest.raises(ValueError, match="needs rows"):
        s.fill(0, torch.zeros(2, 4))
    s.fill(1, torch.ones(2, 4))
    assert s.ready_until() == 2  # span 1 waits for span 0
    s.fill(0, torch.zeros(3, 4))
    assert s.ready_until() == 12 and s.complete
    mask, rows = s.rows(0, 12)
    assert mask.tolist() == [False] * 2 + [True] * 3 + [False] * 2 + [True] * 2 + [False] * 3
    assert rows.shape == (5, 4) and rows[3:].eq(1).all() and rows[:3].eq(0).all()
    mask, rows = s.rows(4, 8)
    assert mask.tolist() == [True, False, False, True] and rows.shape == (2, 4)
    with pytest.raises(ValueError, match="already filled"):
        s.fill(0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="overlap"):
        EmbeddingStream(12, [PlaceholderSpan(2, 5, "a"), PlaceholderSpan(4, 6, "b")], 4)
    with pytest.raises(ValueError, match="past the prompt"):
        EmbeddingStream(4, [PlaceholderSpan(2, 5, "a")], 4)
    with pytest.raises(ValueError, match="start < end"):
        PlaceholderSpan(3, 3, "x")
