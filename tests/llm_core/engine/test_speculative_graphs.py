"""Fixed-shape decode steps under MTP speculation (llm_engine.py, fixed_decode/decode_graphs.py): the
steps where no request drafts -- adaptive k at 0 for every request of the batch -- run through the
fixed-shape graphs as plain decoding does, and so do verify steps that fit a bucket, each new token a
decode row of its own (``VerifyRows``); the tokens equal plain decoding's.

Random MTP layers almost never guess right, so the adaptive length drops every request to 0 after
its first verify and then probes now and then: plain graph steps and verify steps (with their
rollbacks) interleave, and the persistent batch must rewrite every row a verify step moved. With an
*oracle* draft (the plain continuation, some tokens corrupted) most steps verify, with every accepted
length 0..k."""

from __future__ import annotations

import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.fixed_decode.step_rows import VerifyRows
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 4
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, **kw) -> LLMEngine:
    cfg = dict(page_size=PAGE, max_chunk_tokens=5, max_num_batched_tokens=32, num_full_tokens=2048,
               num_swa_tokens=512, compile_decode=False)
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def _count_graph_steps(eng: LLMEngine, method: str = "forward") -> list[int]:
    graphs, calls = eng.runner.decode_graphs, []
    real = getattr(graphs, method)

    def counted(entries, kv):
        calls.append(sum(e.num_new_tokens for e in entries))
        return real(entries, kv)

    setattr(graphs, method, counted)
    return calls


def _with_oracle(eng: LLMEngine, reference: dict[tuple, list[int]], corrupt: float, seed: int) -> None:
    """Each draft replaced by the plain continuation, a token corrupted with probability ``corrupt``
    (the real draft runs first: its KV writes and rows stay)."""
    proposer, rng = eng.speculative.proposer, random.Random(seed)
    real = proposer.draft

    def draft(entries, kv):
        real(entries, kv)
        for e in entries:
            ref, have = reference[tuple(e.request.prompt_token_ids)], e.request.num_output_tokens
            for i in range(e.num_draft_tokens):
                tok = ref[have + i] if have + i < len(ref) else 7
                e.request.token_ids[e.start + 1 + i] = rng.randrange(3, 500) if rng.random() < corrupt else tok

    proposer.draft = draft


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", mtp_layers=3), dtype=torch.float32)


@pytest.mark.parametrize("buckets", [(1, 2, 4), (4, 8, 16)])
def test_verify_steps_run_fixed_shape_and_equal_plain_decoding(model, buckets):
    """Oracle drafts: verify steps of 1 + k rows per request (k up to 3) replay the buckets (with
    buckets up to 4, a batch's verify rows often exceed the largest: those steps stay eager), every
    accepted length rolls back differently, and the tokens and logprobs equal plain decoding's."""
    prompts = [ids(80 + i, n) for i, n in enumerate((6, 11, 3, 9))]
    want = LLM.from_engine(engine(model, speculative_tokens=0)).generate(prompts, PARAMS)
    eng = engine(model, speculative_tokens=3, speculative_adaptive=False)
    eng.runner.enable_decode_graphs(eng.pool, buckets=buckets, mode="eager", max_model_len=eng.max_model_len)
    _with_oracle(eng, {tuple(p): o.token_ids for p, o in zip(prompts, want)}, corrupt=0.3, seed=5)
    verify_rows = _count_graph_steps(eng, "forward_rows")
    got = LLM.from_engine(eng).generate(prompts, PARAMS)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    stats = eng.stats()
    assert stats.spec_accepted_tokens > 20 and verify_rows and max(verify_rows) <= buckets[-1]
    if buckets[-1] == 16:  # every verify step of the four requests fits: each replays
        assert len(verify_rows) >= 10 and max(verify_rows) > len(prompts)
        assert set(stats.spec_accepted_length) == {"0", "1", "2", "3"}
    assert set(stats.spec_accepted_length) >= {"0", "3"}
    eng.prefix_cache.clear()
    assert eng.pool.full.num_used == 1 and eng.pool.swa.num_used == 1  # the scratch pages only


def test_plain_steps_under_mtp_run_fixed_shape_and_equal_plain_decoding(model):
    prompts = [ids(60 + i, n) for i, n in enumerate((6, 11, 3))]
    want = LLM.from_engine(engine(model, speculative_tokens=0)).generate(prompts, PARAMS)
    eng = engine(model, speculative_tokens=3)
    assert eng.runner.decode_graphs is None  # off on CPU by default, with or without MTP
    eng.runner.enable_decode_graphs(eng.pool, buckets=(1, 2, 4), mode="eager", max_model_len=eng.max_model_len)
    graph_steps = _count_graph_steps(eng)
    got = LLM.from_engine(eng).generate(prompts, PARAMS)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    stats = eng.stats()
    assert stats.spec_draft_tokens > 0 and len(graph_steps) > 20  # both kinds of step ran
    eng.runner.decode_graphs.batch.check_integrity()
    eng.prefix_cache.clear()
    assert eng.pool.full.num_used == 1 and eng.pool.swa.num_used == 1  # the scratch pages only


def test_graphs_are_on_under_mtp_where_the_device_has_them():
    """The fixed-shape mode no longer depends on MTP: CUDA captures graphs with or without it."""
    assert EngineConfig(speculative_tokens=3).decode_mode("cuda") == "cudagraph"
    assert EngineConfig(speculative_tokens=3).decode_mode("cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (.ci/gpu runs it on a GPU machine)")
def test_cuda_graph_steps_under_mtp_equal_eager(tmp_path):
    """On a GPU, by default: the MTP engine captures its buckets at start-up; its plain steps and
    its verify steps (oracle drafts) replay them; the tokens equal an eager engine's (--enforce-eager)."""
    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf", mtp_layers=3), dtype=torch.float32, device="cuda")
    prompts = [ids(70 + i, n) for i, n in enumerate((6, 11, 3))]
    eager = LLM.from_engine(engine(model, speculative_tokens=0)).generate(prompts, PARAMS)
    eng = engine(model, speculative_tokens=3, speculative_adaptive=False, compile_decode=None)
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.mode == "cudagraph"
    _with_oracle(eng, {tuple(p): o.token_ids for p, o in zip(prompts, eager)}, corrupt=0.3, seed=7)
    verify_rows = _count_graph_steps(eng, "forward_rows")
    got = LLM.from_engine(eng).generate(prompts, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager] and verify_rows
    assert eng.runner.decode_graphs.mode == "cudagraph"  # no capture fell back to eager


def _entry(rid: str, tokens: list[int], start: int, full: list[int], swa: list[int]) -> ScheduledRequest:
    req = SimpleNamespace(request_id=rid, token_ids=tokens, full_pages=full, swa_pages=swa, num_prompt_tokens=1)
    return ScheduledRequest(req, start, len(tokens) - start)


def test_verify_rows_are_causal_rows_and_refill_back_to_padding():
    """Each new token a row ending at itself, over its request's tables (a released SWA page stays
    -1); a smaller refill leaves every row it does not use in the padding state."""
    rows = VerifyRows(8, 6, PAGE, scratch_pages=(90, 91))
    a = _entry("a", list(range(10, 21)), 7, [3, 4, 5], [-1, 8, 9])  # 4 new tokens at positions 7..10
    b = _entry("b", [1, 2, 3], 2, [6], [7])  # a plain decode
    assert rows.fill([a, b]) == 5
    assert rows.positions[:5].tolist() == [7, 8, 9, 10, 2] and rows.seq_lens[:5].tolist() == [8, 9, 10, 11, 3]
    assert rows.token_ids[:5].tolist() == [17, 18, 19, 20, 3]
    assert rows.full_table[3, :4].tolist() == [3, 4, 5, -1] and rows.swa_table[0, :3].tolist() == [-1, 8, 9]
    assert rows.full_table[5, :2].tolist() == [90, -1]  # padding: the scratch page
    assert rows.fill([b]) == 1
    assert rows.positions[:3].tolist() == [2, 0, 0] and rows.seq_lens[:3].tolist() == [3, 1, 1]
    assert (rows.full_table[1:, 1:] == -1).all() and (rows.full_table[1:, 0] == 90).all()
    assert (rows.swa_table[1:, 0] == 91).all()


def test_verify_replays_with_cuda_stood_in(model, monkeypatch):
    """The CUDA-graph bookkeeping of verify steps on CPU, torch.cuda's graph calls stood in (a replay
    computes nothing, so no tokens are checked): verify steps replay the graphs start-up captured --
    no capture mid-serving -- after copying their rows into the static buffers: each verify token's
    position and its own length (causal)."""
    captures, replays = [], []

    @contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        captures.append(g)
        yield

    class Graph:
        def replay(self) -> None:
            static = next(st for gr, st, _ in eng.runner.decode_graphs._graphs.values() if gr is self)
            replays.append((static["positions"].tolist(), static["seq_lens"].tolist()))

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "engine stream")
    eng = engine(model, speculative_tokens=3, speculative_adaptive=False)
    eng.runner.enable_decode_graphs(eng.pool, buckets=(4, 8), mode="cudagraph", max_model_len=eng.max_model_len)
    assert eng.runner.decode_graphs.mode == "cudagraph"
    started = len(captures)
    verify_rows = _count_graph_steps(eng, "forward_rows")
    LLM.from_engine(eng).generate([ids(90, 6), ids(91, 9)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(captures) == started and verify_rows and replays
    # a verify replay of two requests at k = 3: rows 0..3 and 4..7, each row's length its position + 1
    positions, lengths = next(r for r in replays if len(r[0]) == 8 and r[1][3] > 1)
    assert lengths == [p + 1 for p in positions] and positions[1] == positions[0] + 1
