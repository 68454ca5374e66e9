"""Fixed-shape decode steps per batch bucket (llm_core/engine/fixed_decode/decode_graphs.py): the persistent batch
keeps its rows right under random joins / leaves / page growth / skipped steps; eager fixed-shape
steps give the plain path's tokens (prefix hits, preemption, batches crossing buckets) and write no
KV outside the live requests' new slots and the scratch page; the compiled step gives the same
tokens; the switch is reachable from EngineConfig and the CLI."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.fixed_decode.persistent_batch import PersistentDecodeBatch
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

PAGE = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def engine(model, *, mode: str | None = None, buckets=(1, 2, 4), **kw) -> LLM:
    cfg = dict(page_size=PAGE, max_chunk_tokens=5, max_num_batched_tokens=16, num_full_tokens=2048,
               num_swa_tokens=512, compile_decode=False)
    eng = LLMEngine(model, EngineConfig(**{**cfg, **kw}))
    if mode is not None:
        eng.runner.enable_decode_graphs(eng.pool, buckets=buckets, mode=mode, max_model_len=eng.max_model_len)
    return LLM.from_engine(eng)


# ---- the persistent batch ----------------------------------------------------------------------

def _entry(rid: str, tokens: list[int], full: list[int], swa: list[int]) -> ScheduledRequest:
    req = SimpleNamespace(request_id=rid, token_ids=tokens, full_pages=full, swa_pages=swa, embeds=None,
                          num_prompt_tokens=1, num_tokens=len(tokens))
    return ScheduledRequest(req, len(tokens) - 1, 1)


def test_persistent_batch_rows_follow_random_joins_leaves_and_skipped_steps():
    rng = random.Random(0)
    batch = PersistentDecodeBatch(max_rows=6, max_pages=40, page_size=PAGE, scratch_pages=(0, 0))
    live: dict[str, SimpleNamespace] = {}
    next_page, serial = 1, 0
    for step in range(1, 400):
        if rng.random() < 0.1:
            continue  # a step the persistent batch does not see (a mixed or speculative step)
        for rid in [r for r in live if rng.random() < 0.08]:
            del live[rid]
        while len(live) < 6 and rng.random() < 0.3:
            serial += 1
            live[f"r{serial}"] = SimpleNamespace(tokens=[rng.randrange(9)], full=[], swa=[])
        if rng.random() < 0.05 and live:  # preempted and recomputed: new page lists
            s = rng.choice(list(live.values()))
            s.full, s.swa = [], []
        for s in live.values():
            s.tokens.append(rng.randrange(9))
            while len(s.full) * PAGE < len(s.tokens):
                s.full.append(next_page)
                s.swa.append(next_page + 1000)
                next_page += 1
        entries = [_entry(rid, s.tokens, s.full, s.swa) for rid, s in live.items()]
        rng.shuffle(entries)
        rows = batch.update(entries, step)
        batch.check_integrity()
        assert sorted(rows) == list(range(len(entries)))
        for e, r in zip(entries, rows):
            n = len(e.request.full_pages)
            assert batch.full_table[r, :n].tolist() == e.request.full_pages
            assert batch.swa_table[r, :n].tolist() == e.request.swa_pages
            assert (batch.token_ids[r], batch.positions[r], batch.seq_lens[r]) == (e.request.token_ids[-1],
                                                                                  e.start, e.end)
        full, _ = batch.slot_mappings(len(entries))
        for e, r in zip(entries, rows):
            assert full[r] == e.request.full_pages[e.start // PAGE] * PAGE + e.start % PAGE


def test_persistent_batch_refuses_more_rows_or_pages_than_it_holds():
    batch = PersistentDecodeBatch(max_rows=2, max_pages=2, page_size=PAGE, scratch_pages=(0, 0))
    with pytest.raises(ValueError, match="holds 2"):
        batch.update([_entry(f"r{i}", [1], [1], [1]) for i in range(3)], 1)
    with pytest.raises(ValueError, match="3 pages"):
        batch.update([_entry("r", [1] * 9, [1, 2, 3], [1, 2, 3])], 1)


# ---- eager fixed-shape steps == the plain path -------------------------------------------------

PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True) for n in (20, 7, 13, 3, 16)]


def test_fixed_shape_eager_steps_match_the_plain_path(model):
    """Five requests of different lengths and lengths to go: the batch shrinks 5 -> 4 -> 3 -> 2 -> 1
    (5 rows runs plain, the rest pads up to buckets 4, 2, 1)."""
    prompts = [ids(i, n) for i, n in enumerate((9, 30, 17, 3, 22))]
    plain = engine(model).generate(prompts, PARAMS)
    llm = engine(model, mode="eager")
    fixed = llm.generate(prompts, PARAMS)
    for a, b in zip(plain, fixed):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    llm.engine.runner.decode_graphs.batch.check_integrity()
    llm.engine.prefix_cache.clear()
    assert llm.engine.pool.full.num_used == 1 and llm.engine.pool.swa.num_used == 1  # the scratch pages only


def test_fixed_shape_eager_under_preemption_and_prefix_hits(model):
    prompts = [ids(50 + i, 20 + 3 * i) for i in range(6)]
    shared = ids(99, 24)
    prompts += [shared + ids(100 + i, 5) for i in range(2)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = engine(model).generate(prompts, params)
    tight = engine(model, mode="eager", buckets=(2, 8), num_full_tokens=100, num_swa_tokens=68)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_padded_rows_write_no_real_kv_page(model):
    llm = engine(model, mode="eager", buckets=(4,), enable_prefix_caching=False)
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", ids(70 + i, 6 + i), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    running = eng.scheduler.running
    while len(running) < 3 or any(r.num_computed_tokens < r.num_tokens - 1 for r in running):
        eng.step()  # until every request's next step is a decode step
        running = eng.scheduler.running
    before = [(k.clone(), v.clone()) for k, v in (eng.pool.layer(i) for i in range(len(eng.pool.layout.layer_kinds)))]
    decoding = [(r, r.num_tokens - 1) for r in eng.scheduler.running]  # the position each one decodes
    graphs = eng.runner.decode_graphs
    scratch_full = set(range(graphs.batch.scratch_full * PAGE, graphs.batch.scratch_full * PAGE + PAGE))
    scratch_swa = set(range(graphs.batch.scratch_swa * PAGE, graphs.batch.scratch_swa * PAGE + PAGE))
    eng.step()  # one decode step of 3 requests in bucket 4: one padded row
    expect_full = {r.full_pages[p // PAGE] * PAGE + p % PAGE for r, p in decoding}
    expect_swa = {r.swa_pages[p // PAGE] * PAGE + p % PAGE for r, p in decoding}
    for kind, (k0, v0), (k1, v1) in zip(eng.pool.layout.layer_kinds, before,
                                         (eng.pool.layer(i) for i in range(len(before)))):
        changed = set(torch.nonzero((k0 != k1).flatten(1).any(1) | (v0 != v1).flatten(1).any(1))[:, 0].tolist())
        expect, scratch = (expect_full, scratch_full) if kind == "full" else (expect_swa, scratch_swa)
        assert changed - scratch == expect


# ---- compiled == eager --------------------------------------------------------------------------

def test_compiled_decode_step_gives_the_eager_tokens(tmp_path):
    """Two layers (one full, one sliding MoE) and one bucket keep the compile short."""
    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf", num_hidden_layers=2), dtype=torch.float32)
    assert set(model.config.layer_kinds) == {"full", "sliding"} and "moe" in model.config.mlp_kinds
    prompts = [ids(80 + i, n) for i, n in enumerate((11, 6))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = engine(model).generate(prompts, params)
    llm = engine(model, mode="compile", buckets=(2,))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.runner.decode_graphs.compile_seconds > 0


# ---- CUDA graphs (skipped without CUDA; .ci/gpu runs them) ----------------------------------------

def test_graph_bookkeeping_with_cuda_stood_in(model, monkeypatch):
    """The CUDA-graph runner's bookkeeping, on CPU with torch.cuda's graph calls stood in (their
    replay computes nothing, so only what is captured when is checked, not tokens): start-up
    captures each bucket once per key-split count the widths up to max_model_len give (a stand-in
    rule here: the full kind splits 4 ways from 512 keys, 8 from 1024), each capture is told its
    width, and each capture computes its rotary tables inside the graph rather than reading the
    warm-up's (left in the step cache, a graph would replay the capture-time positions); a long
    request then decodes without a capture mid-serving. A capture that fails puts the thread back on
    its stream and the engine decodes eagerly."""
    from contextlib import contextmanager

    from kernels import ops
    from llm_core.model.layers.rope import PartialRotary

    capturing, captured = [False], []
    real_tables = PartialRotary.tables

    def tables(self, positions, dtype):
        if capturing[0]:
            captured[-1]["rope"] += 1
        return real_tables(self, positions, dtype)

    @contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    def splits(q, num_requests, kv_heads, window, keys):
        return 1 if window is not None or keys < 512 else (4 if keys < 1024 else 8)

    monkeypatch.setattr(PartialRotary, "tables", tables)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    streams: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "engine stream")
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    monkeypatch.setattr(ops, "decode_splits", splits)
    from llm_core.engine.fixed_decode import decode_graphs as dg

    real_capture = dg.DecodeGraphs._capture

    def capture(self, ids, fb, kv, keys):
        captured.append({"bucket": ids.shape[0], "keys": keys, "rope": 0})
        return real_capture(self, ids, fb, kv, keys)

    monkeypatch.setattr(dg.DecodeGraphs, "_capture", capture)
    llm = engine(model, mode="cudagraph", buckets=(1, 2))
    graphs = llm.engine.runner.decode_graphs
    assert graphs.mode == "cudagraph" and graphs.max_keys == 1024
    kinds = graphs._attention_kinds
    want = {(b, tuple(splits(None, b, kv, w, k) for kv, w in kinds)) for b in (1, 2) for k in (256, 512, 1024)}
    assert set(graphs._graphs) == want and len(want) == 6
    assert sorted((c["bucket"], c["keys"]) for c in captured) == [(b, k) for b in (1, 2) for k in (256, 512, 1024)]
    assert all(c["rope"] > 0 for c in captured)
    assert all(g[1]["batch"].decode_keys in (256, 512, 1024) for g in graphs._graphs.values())
    n = len(captured)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids(150, 700), ids(151, 5)], params)
    assert [len(o.token_ids) for o in out] == [4, 4] and len(captured) == n and streams == []

    @contextmanager
    def failing_graph(g, pool=None, capture_error_mode="global"):
        yield  # the capture ran, then ending it fails (an op the capture could not take)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    llm = engine(model, mode="cudagraph", buckets=(1, 2))  # a failed capture: back on the engine's stream, eager
    assert llm.engine.runner.decode_graphs.mode == "eager" and streams == ["engine stream"]
    assert [len(o.token_ids) for o in llm.generate([ids(152, 9)], params)] == [4]


@pytest.mark.parametrize("fails_here,others_ok", [(True, True), (False, False), (False, True), ("launch", True)])
def test_a_group_ranks_agree_on_eager_steps_when_a_capture_fails(model, monkeypatch, fails_here, others_ok):
    """A tensor-parallel rank (``agree`` given) whose start-up capture fails neither raises nor runs
    that step eagerly alone (its collectives would run once more than the other ranks'): the ranks
    agree after each capture -- none replays before that, so a rank whose capture failed is never a
    step behind -- and when any failed every rank clears its graphs and decodes eagerly. An eager
    launch that fails part-way is the group's error, not agreed on. ``release`` drops the graphs
    (before NCCL's teardown). torch.cuda's graph calls stood in: bucket 2 fails on this rank or another."""
    from contextlib import contextmanager

    from llm_core.engine.fixed_decode.decode_graphs import DecodeGraphs

    replays = []

    @contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        yield
        if fails_here is True and g.bucket == 2:
            raise RuntimeError("operation not permitted when stream is capturing")

    class Graph:
        bucket = None

        def replay(self) -> None:
            replays.append(self.bucket)

    real_capture, real_logits = DecodeGraphs._capture, DecodeGraphs._logits

    def capture(self, ids, fb, kv, keys):
        Graph.bucket = ids.shape[0]
        return real_capture(self, ids, fb, kv, keys)

    def logits(self, ids, fb, kv):
        if fails_here == "launch" and ids.shape[0] == 2:
            raise RuntimeError("CUDA out of memory in the eager launch")
        return real_logits(self, ids, fb, kv)

    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: graph(g, **kw))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: Graph())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "engine stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(DecodeGraphs, "_logits", logits)
    eng = LLMEngine(model, EngineConfig(page_size=PAGE, num_full_tokens=2048, num_swa_tokens=512, compile_decode=False))
    agreed: list[bool] = []
    graphs = DecodeGraphs(model, eng.pool, buckets=(1, 2, 4), mode="cudagraph", max_model_len=eng.max_model_len,
                          agree=lambda ok: agreed.append(ok) or (ok and (others_ok or len(agreed) < 2)))
    if fails_here == "launch":
        with pytest.raises(RuntimeError, match="out of memory in the eager launch"):
            graphs.warm_up(eng.pool)
        assert agreed == [True] and not graphs._warming
        return
    graphs.warm_up(eng.pool)
    failed = fails_here or not others_ok
    assert graphs.mode == ("eager" if failed else "cudagraph")
    assert (graphs._graphs == {}) == failed
    # this rank's outcome went into every agreement; none after the ranks fell back to eager steps
    assert agreed == ([True, False] if fails_here else [True, True] if not others_ok else [True] * len(agreed))
    assert not graphs._warming and replays == []  # no replay at a group's start-up
    graphs.release()
    assert graphs._graphs == {} and graphs.mode == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (.ci/gpu runs it on a GPU machine)")
def test_cuda_graph_steps_give_the_eager_tokens_beside_another_threads_cuda_work(tmp_path):
    """float32 on CUDA: every bucket captured (at enable) while another thread allocates and
    synchronizes on a stream of its own, as an omni engine's media workers do; the graphs stay on
    (no fallback), that thread sees no error, and the tokens equal the eager fixed-shape steps'."""
    import threading

    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf"), dtype=torch.float32, device="cuda")
    prompts = [ids(120 + i, n) for i, n in enumerate((9, 30, 17))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = engine(model, mode="eager").generate(prompts, params)
    stop, errors = threading.Event(), []

    def busy() -> None:
        stream = torch.cuda.Stream()
        try:
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    torch.empty(int(torch.randint(1 << 10, 1 << 24, ())), device="cuda").fill_(1.0)
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 -- what the test asserts there is none of
            errors.append(exc)

    t = threading.Thread(target=busy)
    t.start()
    try:
        llm = engine(model, mode="cudagraph")
        graphs = llm.engine.runner.decode_graphs
        assert graphs.mode == "cudagraph" and {b for b, _ in graphs._graphs} == set(graphs.buckets)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in eager]
    finally:
        stop.set()
        t.join(30)
    assert not errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (.ci/gpu runs it on a GPU machine)")
def test_cuda_graph_long_context_decode_splits_keys_and_gives_the_eager_tokens(tmp_path):
    """Start-up captures the bucket once per key-split count its contexts can need (more than one
    for the full-attention kind at long contexts: one request's few programs would leave the GPU
    idle); a request with a long context then decodes under the graph of its context's splits,
    beside a short request sharing the bucket, without a capture mid-serving, and the tokens equal
    the eager fixed-shape steps' (which split on the host by the same rule)."""
    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf", max_position_embeddings=4096),
                       dtype=torch.float32, device="cuda")
    prompts = [ids(140, 1500), ids(141, 7)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cfg = dict(max_chunk_tokens=512, max_num_batched_tokens=512, num_full_tokens=4096)
    eager = engine(model, mode="eager", buckets=(2,), **cfg).generate(prompts, params)
    assert [len(o.token_ids) for o in eager] == [6, 6]
    llm = engine(model, mode="cudagraph", buckets=(2,), **cfg)
    graphs = llm.engine.runner.decode_graphs
    start_up = set(graphs._graphs)
    long_splits = graphs.key_splits(2, 2048)  # 1500 + 6 tokens: the 2048-key width
    assert max(long_splits) > 1 and (2, long_splits) in start_up and (2, graphs.key_splits(2, 256)) in start_up
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in eager]
    assert graphs.mode == "cudagraph" and set(graphs._graphs) == start_up


# ---- the switch ---------------------------------------------------------------------------------

def test_decode_mode_defaults_and_flags():
    assert EngineConfig().decode_mode("cpu") is None
    assert EngineConfig().decode_mode("cuda") == "cudagraph"
    assert EngineConfig(compile_decode=True).decode_mode("cpu") == "compile"
    assert EngineConfig(compile_decode=False).decode_mode("cuda") is None
    # tensor/expert parallelism: CUDA graphs on every rank (mirrored) only when asked for, until a
    # multi-GPU run checked them; no torch.compile'd steps
    assert EngineConfig(tensor_parallel_size=2).decode_mode("cuda") is None
    assert EngineConfig(tensor_parallel_size=2, compile_decode=True).decode_mode("cuda") == "cudagraph"
    assert EngineConfig(tensor_parallel_size=2, compile_decode=True).decode_mode("cpu") is None
    with pytest.raises(ValueError, match="decode_buckets"):
        EngineConfig(decode_buckets=(0, 4))
    from mm_pipeline.cli import build_parser
    from mm_pipeline.runtime.config import OmniEngineConfig

    args = build_parser().parse_args(["serve", "--model", "m", "--compile-decode", "--decode-buckets", "1",
                                      "--decode-buckets", "8"])
    from mm_pipeline.config_flags import config_flags, config_values

    cfg = OmniEngineConfig.from_kwargs(**config_values(args, config_flags()))
    assert cfg.engine.compile_decode is True and cfg.engine.decode_buckets == (1, 8)
    args = build_parser().parse_args(["serve", "--model", "m", "--enforce-eager"])
    assert OmniEngineConfig.from_kwargs(**config_values(args, config_flags())).engine.compile_decode is False
