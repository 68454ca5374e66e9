"""Fixed-shape decode steps under MTP speculation (llm_engine.py, fixed_decode/decode_graphs.py): the
steps where no request drafts -- adaptive k at 0 for every request of the batch -- run through the
fixed-shape graphs, verify steps stay eager, and the tokens equal plain decoding's. Random MTP layers
almost never guess right, so the adaptive length drops every request to 0 after its first verify and
then probes now and then: graph steps and verify steps (with their rollbacks) interleave, and the
persistent batch must rewrite every row a verify step moved."""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
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


def _count_graph_steps(eng: LLMEngine) -> list[int]:
    graphs, calls = eng.runner.decode_graphs, []
    real = graphs.forward

    def forward(entries, kv):
        calls.append(len(entries))
        return real(entries, kv)

    graphs.forward = forward
    return calls


def test_plain_steps_under_mtp_run_fixed_shape_and_equal_plain_decoding(tmp_path):
    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf", mtp_layers=3), dtype=torch.float32)
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
def test_cuda_graph_plain_steps_under_mtp_equal_eager(tmp_path):
    """On a GPU, by default: the MTP engine captures its buckets at start-up and its plain steps
    replay them; the tokens equal an eager engine's (--enforce-eager)."""
    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf", mtp_layers=3), dtype=torch.float32, device="cuda")
    prompts = [ids(70 + i, n) for i, n in enumerate((6, 11, 3))]
    eager = LLM.from_engine(engine(model, speculative_tokens=3)).generate(prompts, PARAMS)
    eng = engine(model, speculative_tokens=3, compile_decode=None)
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.mode == "cudagraph"
    graph_steps = _count_graph_steps(eng)
    got = LLM.from_engine(eng).generate(prompts, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager] and graph_steps
