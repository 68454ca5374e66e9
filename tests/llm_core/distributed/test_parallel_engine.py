"""Tensor / expert parallelism end to end on CPU: LLM(...) spawns a second rank, the two ranks talk
over gloo on loopback, and greedy generation equals one process.

Tolerance: the all-reduces sum partial results in another order than one process's matmuls, so fp32
logprobs may differ by a few ulps (seen: <= 1e-6); greedy tokens must be identical.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.distributed.parallel_context import ParallelContext
from llm_core.distributed.rank_failure import RankFailure
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout

pytestmark = pytest.mark.usefixtures("one_thread")

LOGPROB_TOL = 1e-5
# explicit pool sizes so every run has the same pages (KV bytes then compare as head shares); a small
# chunk so long prompts take several prefill steps; prefix caching on (the default)
ENGINE = dict(num_full_tokens=2048, num_swa_tokens=1024, max_chunk_tokens=24, distributed_timeout_s=60)
PROMPTS = [list(range(5, 70)), [30, 31, 32], list(range(100, 141))]
SHARED = list(range(5, 69)) + [400, 401]  # shares PROMPTS[0]'s 4 whole pages (kept: its last whole page)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    hf = build_tiny_hf_checkpoint(root / "hf", seed=7)
    return {"hf": hf, "hub_fp8": write_hub_layout(hf, root / "hub_fp8", fp8=True)}


class _MediaRows:
    """An EmbeddingSource: positions [3, 9) of the prompt take fixed random rows (the multimodal
    path: rank 0 embeds the text rows through every rank, splices these, broadcasts the result)."""

    def __init__(self, prompt_len: int, hidden: int) -> None:
        self.prompt_len = prompt_len
        self.values = torch.randn(6, hidden, generator=torch.Generator().manual_seed(5))

    def ready_until(self) -> int:
        return self.prompt_len

    def rows(self, start: int, end: int):
        mask = torch.tensor([3 <= p < 9 for p in range(start, end)])
        return mask, self.values[[p - 3 for p in range(start, end) if 3 <= p < 9]]


def _run(llm: LLM):
    first = llm.generate(PROMPTS, PARAMS)
    second = llm.generate([SHARED], PARAMS)  # after the first batch finished: a prefix-cache hit
    prompt = [7] * 3 + [0] * 6 + list(range(200, 230))
    llm.engine.add_request("media", prompt, PARAMS, embeds=_MediaRows(len(prompt), llm.engine.model_config.hidden_size))
    media = None
    while media is None:
        media = next((o for o in llm.engine.step() if o.finished), None)
    # prompt logprobs: every prompt row's logits, a block of rows at a time, named to every rank
    scored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    return first + second + [media] + scored


@pytest.fixture(scope="module")
def reference(checkpoints):
    out = {}
    for name, path in checkpoints.items():
        with LLM(path, **ENGINE) as llm:
            out[name] = (_run(llm), llm.engine.pool.full_bytes + llm.engine.pool.swa_bytes)
    return out


@pytest.mark.parametrize("layout,tp,ep", [("hf", 2, 1), ("hub_fp8", 1, 2), ("hub_fp8", 2, 2)])
def test_parallel_generation_equals_one_process(checkpoints, reference, layout, tp, ep):
    want, kv_bytes_one = reference[layout]
    with LLM(checkpoints[layout], tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE) as llm:
        # every rank's KV pools exist before the first request (allocated at start-up)
        assert len({r["kv_bytes"] for r in llm.engine.runner.model.reports(llm.engine.pool)}) == 1
        got = _run(llm)
        reports = llm.engine.runner.model.reports(llm.engine.pool)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.num_cached_tokens == w.num_cached_tokens
        assert max((abs(a - b) for a, b in zip(g.logprobs or [], w.logprobs or [])), default=0) <= LOGPROB_TOL
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        if w.prompt_logprobs is not None:
            assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(w.prompt_logprobs)
            assert max(abs(a - b) for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:])) <= LOGPROB_TOL
            assert [sorted(t) for t in g.prompt_top_logprobs] == [sorted(t) for t in w.prompt_top_logprobs]
    assert got[-1].prompt_logprobs is not None and got[-1].num_cached_tokens == 0
    assert got[-3].num_cached_tokens == 64  # prefix caching works across ranks
    # each rank holds its share: the weights of its slice, its KV heads of both pools
    for r, rep in enumerate(reports):
        shard = load_model(checkpoints[layout], parallel=ParallelContext(tp, ep, r))
        assert rep["weight_bytes"] == sum(p.numel() * p.element_size() for p in shard.parameters())
        assert rep["kv_bytes"] == kv_bytes_one // tp
        assert rep["experts"] == (r * 8 // ep, (r + 1) * 8 // ep) if ep > 1 else rep["experts"] == (0, 8)


def test_fp8_experts_on_every_rank_equal_one_process(checkpoints, reference):
    """TP=2 + EP=2 with every rank's routed experts kept in block-FP8 as the checkpoint stores them
    (``fp8_experts``; on CPU dequantised per call to the same values one process dequantises at
    load): the same tokens, logprobs within the all-reduce tolerance, and each rank's expert stacks
    at 1 byte a weight."""
    want, _ = reference["hub_fp8"]
    with LLM(checkpoints["hub_fp8"], tensor_parallel_size=2, expert_parallel_size=2, fp8_experts=True, **ENGINE) as llm:
        got = llm.generate(PROMPTS, PARAMS)
        reports = llm.engine.runner.model.reports(llm.engine.pool)
    for w, g in zip(want[:len(PROMPTS)], got):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= LOGPROB_TOL
    for r, rep in enumerate(reports):
        kept = load_model(checkpoints["hub_fp8"], parallel=ParallelContext(2, 2, r), fp8_experts=True)
        plain = load_model(checkpoints["hub_fp8"], parallel=ParallelContext(2, 2, r))
        assert rep["weight_bytes"] == sum(t.numel() * t.element_size() for t in kept.parameters()) + sum(
            b.numel() * b.element_size() for n, b in kept.named_buffers() if n.endswith("_scale_inv"))
        experts = [(a, b) for (n, a), b in zip(kept.named_parameters(), plain.parameters()) if ".experts." in n]
        assert experts and all(a.element_size() == 1 and b.element_size() == 4 for a, b in experts)


@pytest.mark.parametrize("layout,tp,ep", [("hf", 2, 1), ("hub_fp8", 2, 2)])
def test_fixed_shape_decode_steps_on_every_rank_equal_one_process(checkpoints, reference, layout, tp, ep):
    """Fixed-shape decode steps (CUDA graphs on GPUs; here their eager stand-in, the same inputs,
    padding and buckets) mirrored to the other rank: every rank builds its own over its shard and KV
    share, each decode step goes out with its input rows and every rank runs that bucket's step; the
    tokens equal one process's, logprobs within the all-reduce tolerance."""
    want, _ = reference[layout]
    with LLM(checkpoints[layout], tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE) as llm:
        engine = llm.engine
        engine.runner.enable_decode_graphs(engine.pool, buckets=(1, 2, 4), mode="eager",
                                           max_model_len=engine.max_model_len)
        graphs = engine.runner.decode_graphs
        steps, mirror = [], graphs.mirror
        graphs.mirror = lambda bucket, rows, run: steps.append(bucket) or mirror(bucket, rows, run)
        got = llm.generate(PROMPTS, PARAMS)
        engine.check_health()
    assert steps and set(steps) <= {1, 2, 4}
    for w, g in zip(want[:len(PROMPTS)], got):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= LOGPROB_TOL


def test_a_dead_rank_ends_the_engine_with_an_error(checkpoints):
    """Rank 1 is killed while a long generation runs (mid-step: rank 0 sits in a collective or is
    sending the next step): generate raises RankFailure naming it within seconds, close() is quick."""
    import threading

    llm = LLM(checkpoints["hf"], tensor_parallel_size=2, **ENGINE)
    try:
        worker = llm.engine.runner.model.group.processes[0]
        long = SamplingParams(max_tokens=700, temperature=0.0, ignore_eos=True)
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([list(range(5, 300))] * 4, long)
        assert time.monotonic() - start < 20
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 15
    assert not torch.distributed.is_initialized()


TORCHRUN_SCRIPT = """
import os, sys, torch
torch.set_num_threads(1)
from llm_core import LLM, SamplingParams
from llm_core.engine.engine_config import pool_sizing
from llm_core.kvcache import dual_pool
SMALL = 40 << 20  # the SWA pool needs ~25 MB of it, rank 0 gives its Full pool ~40 MB
if os.environ["RANK"] == "1":  # this rank has less memory to give the KV pools than rank 0
    dual_pool.DEFAULT_CPU_KV_CACHE_BYTES = SMALL
with LLM(sys.argv[1], tensor_parallel_size=2, distributed_timeout_s=60) as llm:
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0))
    print("RANK", os.environ["RANK"], out[0].token_ids, flush=True)
    engine = llm.engine
    pool = engine.pool
    want = pool_sizing(engine.config, pool.layout, dtype=engine.dtype, device=engine.device,
                       max_model_len=engine.max_model_len, prefix_caching=True, default_budget=lambda d, f: SMALL)
    print("POOL", pool.full.num_pages * pool.page_size, pool.swa.num_pages * pool.page_size,
          "SIZED", want.num_full_tokens, want.num_swa_tokens,
          "KV", [r["kv_bytes"] for r in engine.runner.model.reports(pool)], flush=True)
"""


def test_torchrun_started_ranks(checkpoints, tmp_path):
    """Under torchrun nothing is spawned: rank 0 returns from LLM(...) and generates, rank 1 serves
    rank 0's steps inside LLM(...) and exits when rank 0 closes. Rank 1 has a smaller default KV
    budget: both ranks' pools are sized from it (the old rank 0 sized them from its own)."""
    import subprocess
    import sys

    from llm_core.distributed.rank_group import free_port

    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    with LLM(checkpoints["hf"], **ENGINE) as llm:
        want = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(script), str(checkpoints["hf"])],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"RANK 0 {want}" in run.stdout and "RANK 1" not in run.stdout
    pool = next(line.split() for line in run.stdout.splitlines() if line.startswith("POOL"))
    assert pool[1:3] == pool[4:6], pool  # rank 0's pools: rank 1's budget
    kv = eval(" ".join(pool[7:]))
    assert kv[0] == kv[1] <= 40 << 20, kv
