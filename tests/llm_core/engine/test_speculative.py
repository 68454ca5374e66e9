"""MTP speculative decoding on a tiny random checkpoint with MTP layers: greedy outputs (tokens and
logprobs) equal non-speculative decoding under chunked prefill, prefix caching, preemption, stop
conditions and both layer modes; rejected KV is rolled back in both pools (every page free at the end,
the prefix cache's invariants hold); sampled verification keeps the target distribution.

Random MTP layers almost never guess right, so most tests swap the drafted tokens for an *oracle*:
the non-speculative continuation with random corruptions. The real draft still runs first (its KV
writes, its rows), so every accepted length 0..k and every rollback shape is exercised."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.sampling import Sampler
from llm_core.engine.speculative.verify import target_probs, verify_sampled
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout
from tests.support.draft_compare import compare_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE, CHUNK = 4, 5


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", mtp_layers=3))


def engine(model, **kw) -> LLMEngine:
    cfg = dict(page_size=PAGE, max_chunk_tokens=CHUNK, max_num_batched_tokens=32, num_full_tokens=2048,
               num_swa_tokens=512)
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def with_oracle(eng: LLMEngine, reference: dict[tuple, list[int]], corrupt: float, seed: int) -> LLMEngine:
    """Replace each draft by the reference continuation, each token corrupted with prob ``corrupt``."""
    proposer, rng = eng.speculative.proposer, random.Random(seed)
    real = proposer.draft

    def draft(entries, kv):
        real(entries, kv)
        for e in entries:
            req, k = e.request, e.num_draft_tokens
            ref = reference[tuple(req.prompt_token_ids)]
            have = req.num_output_tokens
            for i in range(k):
                tok = ref[have + i] if have + i < len(ref) else 7
                req.token_ids[e.start + 1 + i] = rng.randrange(3, 500) if rng.random() < corrupt else tok

    proposer.draft = draft
    return eng


def generate(eng: LLMEngine, prompts, params):
    return LLM.from_engine(eng).generate(prompts, params)


def drained(eng: LLMEngine) -> bool:
    eng.prefix_cache.clear()
    return eng.pool.all_free()


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def reference_outputs(model, prompts, params=GREEDY, **kw):
    outs = generate(engine(model, speculative_tokens=0, **kw), prompts, params)
    return outs, {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
            for tx, ty in zip(x.top_logprobs, y.top_logprobs):
                assert tx.keys() == ty.keys()


@pytest.mark.parametrize("mode", ["first", "chain"])
def test_greedy_equals_plain_decoding_with_prefix_cache_and_chunks(model, mode):
    shared = ids(1, 13)
    prompts = [ids(2, 5), shared + ids(3, 6), shared + ids(4, 9), ids(5, 30), [9]]
    ref, table = reference_outputs(model, prompts)
    eng = with_oracle(engine(model, speculative_tokens=3, speculative_layers=mode, speculative_adaptive=False),
                      table, corrupt=0.3, seed=0)
    out = generate(eng, prompts, GREEDY)
    out2 = generate(eng, prompts, GREEDY)  # now with prefix-cache hits on everything
    assert_same(ref, out)
    assert_same(ref, out2)
    assert any(o.num_cached_tokens for o in out2)
    s = eng.stats()
    hist = {int(a): n for a, n in s.spec_accepted_length.items()}
    assert s.spec_verify_steps == sum(hist.values()) > 0
    assert s.spec_accepted_tokens == sum(a * n for a, n in hist.items())
    assert hist[0] and hist[3] and (hist[1] or hist[2])  # every accepted length happens
    assert 0 < s.spec_acceptance_rate < 1 and s.to_dict()["spec_mean_accepted_tokens"] > 1
    # several tokens a verify step, each counted once
    assert s.generation_tokens == sum(len(o.token_ids) for o in out + out2) == 2 * len(prompts) * GREEDY.max_tokens
    eng.prefix_cache.check_integrity([])
    assert drained(eng)


def test_real_mtp_drafts_random_weights_still_exact(model):
    prompts = [ids(10 + i, n) for i, n in enumerate((3, 11, 26))]
    ref, _ = reference_outputs(model, prompts)
    for mode in ("first", "chain"):
        eng = engine(model, speculative_tokens=3, speculative_layers=mode, speculative_adaptive=False)
        assert_same(ref, generate(eng, prompts, GREEDY))
        assert eng.stats().spec_draft_tokens > 0
        assert drained(eng)


def test_first_mode_draft_steps_equal_per_step_batches(model):
    """The first mode's module-path draft (inputs of all k steps built once, draft_steps.py; the
    reference the fused draft is tested against, test_fused_draft.py) drafts the tokens the per-step
    path (build_forward_batch and a fresh attention plan per step) drafts, with requests of different
    k in one batch (max_tokens caps k near the end) and windows past the SWA release."""
    prompts = [ids(40 + i, n) for i, n in enumerate((3, 13, 22))]
    eng = engine(model, speculative_tokens=3, speculative_adaptive=False)
    checked = compare_drafts(eng, "_draft_first", "_draft_rows")  # not the engine's own (fused) draft
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 17, 24)]
    outs = LLM.from_engine(eng).generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [30, 17, 24]
    checked = [sorted(set(ks)) for _, ks, _ in checked]
    assert any(len(ks) > 1 for ks in checked) and max(max(ks) for ks in checked) == 3
    assert [3] in checked  # steps where every request drafts as many tokens (no inactive cells)


def test_preemption_under_tiny_pools(model):
    prompts = [ids(20 + i, 9) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref, table = reference_outputs(model, prompts, params, enable_prefix_caching=False)
    eng = with_oracle(engine(model, speculative_tokens=3, speculative_adaptive=False, num_full_tokens=64,
                             num_swa_tokens=64, enable_prefix_caching=False), table, corrupt=0.2, seed=1)
    assert_same(ref, generate(eng, prompts, params))
    assert eng.scheduler.num_preemptions > 0
    assert eng.pool.all_free()


class CharTokenizer:
    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_stop_strings_stop_ids_and_max_tokens(model):
    prompt = ids(30, 12)
    _, table = reference_outputs(model, [prompt])
    toks = table[tuple(prompt)]
    text = CharTokenizer().decode(toks)
    cases = [dict(stop_token_ids=[toks[5]]), dict(stop=[text[6:8]]), dict(max_tokens=7), dict(max_tokens=1)]
    for case in cases:
        params = SamplingParams(**{**dict(max_tokens=20, temperature=0.0, ignore_eos=True), **case})
        plain = LLM.from_engine(LLMEngine(model,
                                          EngineConfig(page_size=PAGE, num_full_tokens=512, speculative_tokens=0),
                                          tokenizer=CharTokenizer())).generate([prompt], params)
        eng = with_oracle(LLMEngine(model, EngineConfig(page_size=PAGE, num_full_tokens=512, speculative_tokens=3,
                                                        speculative_adaptive=False), tokenizer=CharTokenizer()),
                          table, corrupt=0.0, seed=2)
        out = LLM.from_engine(eng).generate([prompt], params)
        assert out[0].token_ids == plain[0].token_ids and out[0].text == plain[0].text, case
        assert drained(eng)


@settings(max_examples=6, deadline=None)
@given(page=st.sampled_from([1, 2, 4, 8]), k=st.integers(1, 4), corrupt=st.floats(0.0, 0.8), seed=st.integers(0, 99),
       window_chunk=st.integers(1, 9))
def test_rollback_property(model, page, k, corrupt, seed, window_chunk):
    """Any page size, draft length, acceptance pattern and chunking: tokens unchanged, pools drained,
    prefix-cache invariants hold."""
    prompts = [ids(seed, 4 + seed % 13), ids(seed + 1, 2 + seed % 5)]
    cfg = dict(page_size=page, max_chunk_tokens=window_chunk, num_full_tokens=1024, num_swa_tokens=512,
               prefix_checkpoint_every=0)
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    ref, table = reference_outputs(model, prompts, params, **cfg)
    eng = with_oracle(engine(model, speculative_tokens=k, speculative_adaptive=False, **cfg), table, corrupt, seed)
    assert_same(ref, generate(eng, prompts + prompts, params))
    eng.prefix_cache.check_integrity([])
    assert drained(eng)


def test_seeded_sampling_is_reproducible(model):
    prompts = [ids(40, 7), ids(41, 3)]
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    a = generate(engine(model, speculative_tokens=3, speculative_adaptive=False), prompts, params)
    b = generate(engine(model, speculative_tokens=3, speculative_adaptive=False), prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_sampled_verification_preserves_the_target_distribution():
    """Small vocabulary: draft token d with target p. The first emitted token must follow p whatever d
    is; given d was accepted, the second must follow the second row's p (chi-square, 3 dof)."""
    g, sampler = torch.Generator().manual_seed(0), Sampler()
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 1.5, 0.2, 0.9], [1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.9)
    p = target_probs(logits, params)
    n = 6000
    for drafts in ([0, 1], [3, 1], [2, 0]):
        first, second = torch.zeros(4), torch.zeros(4)
        for _ in range(n):
            out = verify_sampled(logits, drafts, params, g, sampler)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
        for counts, probs in ((first, p[0]), (second, p[1])):
            expected = probs * counts.sum()
            chi2 = float(((counts - expected) ** 2 / expected).sum())
            assert chi2 < 16.3, (drafts, counts, expected)  # p = 0.001 at 3 degrees of freedom


def test_hub_fp8_mtp_layers_load_like_the_hf_layout(model, tmp_path):
    hf = build_tiny_hf_checkpoint(tmp_path / "hf", mtp_layers=2)
    hub = load_model(write_hub_layout(hf, tmp_path / "hub", fp8=True))
    ref = load_model(hf)
    for (name, a), (_, b) in zip(ref.model.mtp.named_parameters(), hub.model.mtp.named_parameters()):
        assert torch.allclose(a, b, atol=0.03), name  # FP8 rounding of 0.08-std weights
    assert not hasattr(load_model(hf, load_mtp=False).model, "mtp")
    assert LLMEngine(load_model(hf, load_mtp=False), EngineConfig(page_size=PAGE, num_full_tokens=256)).speculative is None


def test_adaptive_engine_stops_drafting_when_drafts_fail(model):
    """Random MTP layers: adaptive k falls to 0 after the first verify, then only probes."""
    prompts = [ids(50 + i, 6) for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref, _ = reference_outputs(model, prompts, params)
    eng = engine(model, speculative_tokens=3)
    assert_same(ref, generate(eng, prompts, params))
    s = eng.stats()
    assert s.spec_draft_tokens < 3 * 3 + 3 * 40 // 16 + 3  # first guesses + one probe per 16 steps


@pytest.mark.parametrize("mode", ["first", "chain"])
def test_kv_only_extend_stores_what_the_full_layer_stores(model, monkeypatch, mode):
    """The extend's last MTP layer only writes its K/V (MTPLayer.write_kv): the same values, bit for
    bit, as its full forward would store, over prefill chunks and verify rows alike."""
    from llm_core.model.mtp import MTPLayer

    real, checked = MTPLayer.write_kv, []

    def both(self, embeds, h_prev, batch, k_cache, v_cache):
        k_full, v_full = k_cache.clone(), v_cache.clone()
        MTPLayer.forward(self, embeds, h_prev, batch, k_full, v_full)
        real(self, embeds, h_prev, batch, k_cache, v_cache)
        assert torch.equal(k_full, k_cache) and torch.equal(v_full, v_cache)
        checked.append(embeds.shape[0])

    monkeypatch.setattr(MTPLayer, "write_kv", both)
    eng = engine(model, speculative_tokens=3, speculative_layers=mode, speculative_adaptive=False)
    generate(eng, [ids(60, 12), ids(61, 3)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert max(checked) >= 4 and min(checked) >= 1


@pytest.mark.parametrize("mode", ["first", "chain"])
def test_lone_request_verify_rows_through_the_c_kernel_equal_flash(model, monkeypatch, mode):
    """Batch 1: a verify step's 1 + k rows go to the C decode kernel, one decode row per query
    (kernels/cpu/attention_plan.py; inside the one-call layer, kernels/native/fused_layer.c, or the
    layer's own attention call); the tokens equal the flash path's (kernels off) and plain decoding's."""
    from kernels.native import build, fused_layer, paged_decode

    if paged_decode._lib() is None:
        pytest.skip("no C compiler: the flash path serves")
    monkeypatch.setattr(build, "_enabled", build.enabled())  # the engines flip the process switch: restore it
    rows, real, real_layer = [], paged_decode.decode_attention, fused_layer.decode_layer

    def counted(q, k_cache, v_cache, decode, **kw):
        rows.append(decode.rows.numel())
        return real(q, k_cache, v_cache, decode, **kw)

    def counted_layer(consts, step, x, k_cache, v_cache, decode):
        rows.append(decode.rows.numel())
        return real_layer(consts, step, x, k_cache, v_cache, decode)

    monkeypatch.setattr(paged_decode, "decode_attention", counted)
    monkeypatch.setattr(fused_layer, "decode_layer", counted_layer)
    prompts = [ids(70, 9), ids(71, 23)]
    ref, table = reference_outputs(model, prompts, max_num_seqs=1)
    outs = {}
    for native in (True, False):
        rows.clear()
        eng = with_oracle(engine(model, speculative_tokens=3, speculative_layers=mode, speculative_adaptive=False,
                                 max_num_seqs=1, native_cpu_kernels=native), table, corrupt=0.3, seed=1)
        outs[native] = generate(eng, prompts, GREEDY)
        assert (4 in rows) == native  # the 4 verify rows of one request: one kernel call per layer
        assert drained(eng)
    assert_same(ref, outs[True])
    assert_same(outs[False], outs[True])


def test_the_owners_per_step_hook_is_asked_once_per_speculative_step(model):
    """ModelRunner.before_step (the omni runtime's intra-op threads per step) is asked once per step
    with its rows on the speculative path too -- prefill chunks run the MTP work outside the plain
    runner -- and never twice (a plain step inside the speculative one asks no second time)."""
    prompts = [ids(40 + i, n) for i, n in enumerate((5, 30))]
    ref, _ = reference_outputs(model, prompts)
    eng = engine(model, speculative_tokens=2, speculative_adaptive=False)
    asked: list[int] = []
    eng.runner.before_step = asked.append
    steps = []
    step = eng.step

    def counted():
        out = step()
        steps.append(eng.last_step_progressed)
        return out

    eng.step = counted
    assert_same(ref, generate(eng, prompts, GREEDY))
    assert len(asked) == sum(steps) and max(asked) > 1  # one ask per step that ran; prefill rows seen
    assert eng.runner.before_step == asked.append  # left in place
