"""MTP verify steps (1 + k rows per request) run each decoder layer as one C call
(llm_core/model/layers/fused_decode.py) and give the same tokens, acceptance and logprobs, bit for
bit, as the same steps run part by part, greedy and seeded sampling, at batch 1, 3 and 8 on the tiny
MTP checkpoint (8 experts, top-2: up to 32 rows stay on the C experts kernel)."""

from __future__ import annotations

import pytest
import torch

from kernels.native import build, fused_layer
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.layers.fused_decode import FusedDecode
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(fused_layer._lib() is None, reason="no C compiler: the torch path serves")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", mtp_layers=3),
                      dtype=torch.float32)


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + batch)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in torch.randint(5, 30, (batch,), generator=g)]


def _oracle(eng: LLMEngine, reference: dict[tuple, list[int]]) -> None:
    """Drafts from the plain continuation, every third one wrong: accepted lengths 0..k all occur
    (random MTP layers would almost never draft right)."""
    proposer = eng.speculative.proposer
    real, calls = proposer.draft, [0]

    def draft(entries, kv):
        real(entries, kv)
        for e in entries:
            ref = reference[tuple(e.request.prompt_token_ids)]
            have = e.request.num_output_tokens
            for i in range(e.num_draft_tokens):
                calls[0] += 1
                right = ref[have + i] if have + i < len(ref) else 7
                e.request.token_ids[e.start + 1 + i] = 5 if calls[0] % 3 == 0 else right

    proposer.draft = draft


def _run(model, prompts, params, reference):
    eng = LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=8,
                                        max_num_batched_tokens=256, speculative_tokens=3,
                                        speculative_adaptive=False))
    _oracle(eng, reference)
    outs = LLM.from_engine(eng).generate(prompts, params)
    s = eng.stats()
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs], (s.spec_draft_tokens, s.spec_accepted_tokens)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("seed", [None, 7])
def test_verify_steps_in_one_call_per_layer_equal_part_by_part(model, monkeypatch, batch, seed):
    monkeypatch.setattr(build, "_enabled", build.enabled())  # the engines flip the process switch: restore it
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(batch)
    plain = LLM.from_engine(LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048,
                                                          speculative_tokens=0))).generate(prompts, greedy)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    params = SamplingParams(max_tokens=16, temperature=0.0 if seed is None else 0.1, top_p=0.95, seed=seed,
                            ignore_eos=True, logprobs=3)
    verify_rows = []
    real = FusedDecode.run

    def counted(self, x, batch_, *args):
        out = real(self, x, batch_, *args)
        qsl = batch_.query_start_loc.tolist()
        if out is not None and any(b - a > 1 for a, b in zip(qsl, qsl[1:])):
            verify_rows.append(x.shape[0])
        return out

    monkeypatch.setattr(FusedDecode, "run", counted)
    fused, fused_stats = _run(model, prompts, params, reference)
    assert verify_rows and max(verify_rows) >= 4 * min(batch, 2)  # verify steps went through the one call
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, **k: None)
    parts, parts_stats = _run(model, prompts, params, reference)
    assert fused_stats == parts_stats and fused_stats[1] > 0  # the same acceptance
    for (toks, lps, tops), (rtoks, rlps, rtops) in zip(fused, parts):
        assert toks == rtoks
        assert lps == rlps and tops == rtops  # bit for bit: the same kernels on the same inputs
    if seed is None:
        assert [t for t, _, _ in fused] == [o.token_ids for o in plain]
