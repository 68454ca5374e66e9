"""MTP speculative decoding across tensor / expert-parallel ranks (CPU, gloo, 2 ranks): the MTP
layers are sharded like a sliding layer, and every draft step, extend and draft logits call is
mirrored to the other rank (MirroredModel.mtp_layer / mtp_logits). The drafts a real MTP head
proposes -- which read the MTP KV every rank wrote for its heads -- equal one process's, the tokens
equal plain decoding's, and with oracle drafts every accepted length (and its KV rollback on every
rank) gives plain decoding's tokens too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from llm_core import LLM, SamplingParams
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout

pytestmark = pytest.mark.usefixtures("one_thread")

LOGPROB_TOL = 1e-5  # the all-reduces sum in another order than one process's matmuls
ENGINE = dict(num_full_tokens=2048, num_swa_tokens=1024, max_chunk_tokens=24, distributed_timeout_s=60,
              speculative_adaptive=False)
PROMPTS = [list(range(5, 70)), [30, 31, 32], list(range(100, 141))]
PARAMS = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_mtp")
    hf = build_tiny_hf_checkpoint(root / "hf", seed=11, mtp_layers=3)
    return {"hf": hf, "hub_fp8": write_hub_layout(hf, root / "hub_fp8", fp8=True)}


def recording(llm: LLM, oracle: dict | None = None, corrupt: float = 0.0) -> list[list[int]]:
    """Record every draft rank 0's proposer makes (after ``oracle`` replaced it: the plain run's
    continuation, each token corrupted with probability ``corrupt``)."""
    seen, rng = [], random.Random(0)
    if llm.engine.speculative is None:  # speculative_tokens=0
        return seen
    proposer = llm.engine.speculative.proposer
    real = proposer.draft

    def draft(entries, kv):
        real(entries, kv)
        for e in entries:
            req, k = e.request, e.num_draft_tokens
            if oracle is not None:
                ref, have = oracle[tuple(req.prompt_token_ids)], req.num_output_tokens
                for i in range(k):
                    tok = ref[have + i] if have + i < len(ref) else 7
                    req.token_ids[e.start + 1 + i] = rng.randrange(3, 500) if rng.random() < corrupt else tok
            seen.append(list(req.token_ids[e.start + 1:e.start + 1 + k]))

    proposer.draft = draft
    return seen


def run(path: Path, **kw):
    with LLM(path, **ENGINE, **kw) as llm:
        drafts = recording(llm)
        outs = llm.generate(PROMPTS, PARAMS)
        return outs, drafts, llm.engine.stats()


def same_outputs(got, want) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= LOGPROB_TOL


@pytest.mark.parametrize("layout,tp,ep,mode", [("hf", 2, 1, "first"), ("hub_fp8", 2, 2, "chain")])
def test_real_mtp_drafts_across_ranks_equal_one_process(checkpoints, layout, tp, ep, mode):
    plain, _, _ = run(checkpoints[layout], speculative_tokens=0)
    one, one_drafts, _ = run(checkpoints[layout], speculative_tokens=3, speculative_layers=mode)
    par, par_drafts, stats = run(checkpoints[layout], speculative_tokens=3, speculative_layers=mode,
                                 tensor_parallel_size=tp, expert_parallel_size=ep)
    same_outputs(one, plain)
    same_outputs(par, plain)
    assert stats.spec_draft_tokens > 0 and par_drafts
    # the MTP layer's heads, MLP slice and KV are split over the ranks: its drafts are one process's
    assert par_drafts == one_drafts


def test_every_accepted_length_across_ranks_gives_plain_tokens(checkpoints):
    """Oracle drafts (30 % corrupted): accepted lengths 0..3, each rejected tail's KV rolled back on
    every rank (both pools, the MTP layers' too) before the next step writes there."""
    plain, _, _ = run(checkpoints["hf"], speculative_tokens=0)
    table = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    with LLM(checkpoints["hf"], **ENGINE, speculative_tokens=3, tensor_parallel_size=2) as llm:
        recording(llm, oracle=table, corrupt=0.3)
        first = llm.generate(PROMPTS, PARAMS)
        again = llm.generate(PROMPTS, PARAMS)  # prefix-cache hits: the cached MTP KV is every rank's
        stats = llm.engine.stats()
        llm.engine.check_health()
    same_outputs(first, plain)
    same_outputs(again, plain)
    assert any(o.num_cached_tokens for o in again)
    hist = {int(a): n for a, n in stats.spec_accepted_length.items()}
    assert hist.get(0) and hist.get(3) and (hist.get(1) or hist.get(2))


def test_off_by_default_across_ranks_and_then_not_loaded(checkpoints):
    """With W > 1, MTP is on only when asked for (until a multi-GPU run has checked it), and when it
    is off no rank loads the MTP layers (their weights would only take KV memory); in one process
    the default stays on, and speculative_tokens=0 skips them there too."""
    from llm_core.distributed.parallel_context import ParallelContext
    from llm_core.model.loader import load_model

    with LLM(checkpoints["hf"], **ENGINE, tensor_parallel_size=2) as llm:
        assert llm.engine.speculative is None and not hasattr(llm.engine.runner.model.model, "mtp")
        reports = llm.engine.runner.model.reports(llm.engine.pool)
    for r, rep in enumerate(reports):
        plain = load_model(checkpoints["hf"], parallel=ParallelContext(2, 1, r), load_mtp=False)
        assert rep["weight_bytes"] == sum(p.numel() * p.element_size() for p in plain.parameters())
    with LLM(checkpoints["hf"], **ENGINE) as llm:
        assert llm.engine.speculative is not None
    with LLM(checkpoints["hf"], **ENGINE, speculative_tokens=0) as llm:
        assert llm.engine.speculative is None and not hasattr(llm.engine.runner.model.model, "mtp")
