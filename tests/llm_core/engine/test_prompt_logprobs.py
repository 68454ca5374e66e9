"""vLLM's prompt_logprobs: every prompt token's logprob (and rank, and the top-n) given the tokens
before it equals transformers' log_softmax over the same prompt, whatever the chunking, the batch
around it, a prefix-cache hit another request would take (it takes none), a preemption or MTP
speculative decoding; the generated tokens are the same as without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.sampling import prompt_logprobs as prompt_module
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
from tests.llm_core.engine.test_llm_generate import ckpt, hf_model, ids, model  # noqa: F401 -- fixtures

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 4


def make_engine(model, **kw) -> LLMEngine:
    cfg = dict(page_size=PAGE, max_chunk_tokens=5, max_num_batched_tokens=16, num_full_tokens=2048,
               num_swa_tokens=512)
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def run(eng: LLMEngine, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (p, sp) in prompts.items():
        eng.add_request(rid, p, sp)
    final = {}
    for _ in range(2000):
        for o in eng.step():
            if o.finished and o.request_id in prompts:
                final[o.request_id] = o
        if len(final) == len(prompts):
            return final
    raise AssertionError("requests did not finish")


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax of every row of the prompt [L, V] (float32)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(out, prompt: list[int], ref: torch.Tensor, n: int) -> None:
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert out.prompt_logprob_ranks[0] == 0 and out.prompt_top_logprobs[0] == {}
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        assert out.prompt_logprobs[j] == pytest.approx(row[prompt[j]].item(), abs=1e-4)
        v = row[prompt[j]]  # rank: 1 + the tokens likelier than it (a near-tie may go either way)
        assert int((row > v + 1e-5).sum()) + 1 <= out.prompt_logprob_ranks[j] <= int((row > v - 1e-5).sum()) + 1
        top = out.prompt_top_logprobs[j]
        assert len(top) == n
        if n:
            want = torch.topk(row, n).values.tolist()
            assert sorted(top.values(), reverse=True) == pytest.approx(want, abs=1e-4)
            for tok, lp in top.items():
                assert lp == pytest.approx(row[tok].item(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_under_chunked_prefill(model, hf_model):
    prompts = {"a": ids(11, 23), "b": ids(12, 9), "c": ids(13, 2)}
    sp = {"a": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
          "b": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=1),
          "c": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)}
    out = run(make_engine(model), {k: (p, sp[k]) for k, p in prompts.items()})
    plain = run(make_engine(model), {k: (p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
                                     for k, p in prompts.items()})
    for k, p in prompts.items():
        check(out[k], p, reference(hf_model, p), sp[k].prompt_logprobs)
        assert out[k].token_ids == plain[k].token_ids  # generation is untouched
    assert plain["a"].prompt_logprobs is None and out["b"].logprobs is not None


def test_a_one_token_prompt_has_only_the_empty_first_entry(model):
    out = run(make_engine(model), {"x": ([5], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))})
    assert out["x"].prompt_logprobs == [None] and out["x"].prompt_top_logprobs == [{}]


def test_no_prefix_cache_hit_is_taken_and_the_cache_stays_sound(model, hf_model):
    """A request with prompt_logprobs computes its whole prompt though the cache holds it; a later
    plain request still hits what both left; the radix tree's invariants hold throughout."""
    eng = make_engine(model)
    p = ids(21, 30)
    first = run(eng, {"warm": (p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))})["warm"]
    out = run(eng, {"lp": (p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1))})["lp"]
    assert out.num_cached_tokens == 0
    check(out, p, reference(hf_model, p), 1)
    assert out.token_ids == first.token_ids
    eng.prefix_cache.check_integrity()
    again = run(eng, {"again": (p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))})["again"]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    eng.prefix_cache.check_integrity()
    eng.prefix_cache.clear()
    assert eng.pool.all_free()


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, 9), budget=st.integers(4, 24), n=st.integers(0, 3), length=st.integers(2, 26))
def test_any_chunking_gives_the_same_prompt_logprobs(model, chunk, budget, n, length):
    """Chunk sizes, step budgets and a plain request in the same batch never change them, and each
    prompt token is held once (the rows before a chunk are never asked for again)."""
    p = ids(length, length)
    ref = run(make_engine(model, max_chunk_tokens=64, max_num_batched_tokens=64),
              {"r": (p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=n))})["r"]
    out = run(make_engine(model, max_chunk_tokens=chunk, max_num_batched_tokens=budget),
              {"x": (p, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=n)),
               "y": (ids(99, 13), SamplingParams(max_tokens=4, temperature=0.0))})["x"]
    assert out.prompt_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
    assert out.prompt_logprob_ranks == ref.prompt_logprob_ranks
    assert [sorted(t) for t in out.prompt_top_logprobs] == [sorted(t) for t in ref.prompt_top_logprobs]


def test_preempted_requests_keep_each_prompt_token_once(model, hf_model, monkeypatch):
    """Tight pools preempt requests and compute them again from the start; rows computed again give
    tokens a request holds already, which are not appended twice."""
    monkeypatch.setattr(prompt_module, "LOGITS_BLOCK_ROWS", 3)  # several blocks per chunk as well
    prompts = {f"r{i}": ids(50 + i, 20 + 3 * i) for i in range(6)}
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    eng = make_engine(model, num_full_tokens=96, num_swa_tokens=64)
    out = run(eng, {k: (p, sp) for k, p in prompts.items()})
    assert eng.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        check(out[rid], prompt, reference(hf_model, prompt), 2)
    eng.prefix_cache.clear()
    assert eng.pool.all_free()


def test_rows_given_again_are_held_once():
    from llm_core.engine.request import Request

    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=1), arrival_seq=0)
    req.add_prompt_logprobs(1, (-1.0, -2.0), (1, 2), ({5: -1.0}, {6: -2.0}))
    req.add_prompt_logprobs(1, (-1.0, -2.0, -3.0), (1, 2, 3), ({5: -1.0}, {6: -2.0}, {7: -3.0}))  # recomputed
    assert req.prompt_logprobs == [None, -1.0, -2.0, -3.0] and not req.reads_prefix_cache
    with pytest.raises(RuntimeError, match="from token 5"):
        req.add_prompt_logprobs(5, (-1.0,), (1,), ({},))
    req.add_prompt_logprobs(4, (-4.0,), (4,), ({},))
    assert req.prompt_logprob_ranks == [0, 1, 2, 3, 4] and req.reads_prefix_cache


def test_prompt_logprobs_under_mtp_speculative_decoding(tmp_path, hf_model):
    """With MTP drafting on (the default for a checkpoint with MTP layers), the prefill rows of the
    drafting steps give them too; the checkpoint differs from ``hf_model``, so its own reference."""
    path = build_tiny_hf_checkpoint(tmp_path / "mtp", mtp_layers=1)
    mtp = load_model(path, dtype=torch.float32)
    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    eng = make_engine(mtp, max_num_batched_tokens=32)
    assert eng.speculative is not None
    p, q = ids(41, 17), ids(42, 6)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    # q decodes (drafting) while p's prompt is still being prefilled in chunks
    eng.add_request("q", q, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    eng.step()
    out = run(eng, {"p": (p, sp)})
    check(out["p"], p, reference(hf, p), 2)


def test_bad_values_are_refused():
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_too_many_prompt_logprobs_fail_that_request_alone(model, monkeypatch):
    monkeypatch.setattr(prompt_module, "MAX_PROMPT_LOGPROB_ENTRIES", 30)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    eng = make_engine(model)
    out = run(eng, {"big": (ids(1, 20), sp), "ok": (ids(2, 10), sp)})  # 20 x 2 > 30 >= 10 x 2
    assert out["big"].finish_reason == "error" and out["big"].error_kind == "invalid_input"
    assert "at most 30" in out["big"].error
    assert out["ok"].finish_reason == "length" and len(out["ok"].prompt_logprobs) == 10
    eng.prefix_cache.clear()
    assert eng.pool.all_free()
