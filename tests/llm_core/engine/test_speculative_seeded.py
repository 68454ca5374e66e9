"""Seeded sampling under MTP speculative decoding is plain decoding's: verification emits each token
with the plain sampler's own noise row (one per emitted token), so a seed's tokens and logprobs do not
depend on the batch, on the engine's history (the adaptive draft length, the acceptance prior, the
step gate) nor on whether speculation is on at all.

The random MTP layers of the tiny checkpoint almost never guess right, so the acceptance paths are
exercised with *oracle* drafts: the non-speculative seeded continuation with random corruptions."""

from __future__ import annotations

import random

import pytest
import torch

from llm_core import LLM, LLMEngine, SamplingParams
from llm_core.engine.sampling import Sampler
from llm_core.engine.speculative.verify import verify_sampled
from tests.llm_core.engine.test_speculative import engine, ids, model  # noqa: F401 -- model: a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(eng: LLMEngine, prompts, params):
    return LLM.from_engine(eng).generate(prompts, params)


def with_oracle(eng: LLMEngine, reference: dict[tuple, list[int]], corrupt: float, seed: int) -> LLMEngine:
    """Replace each draft by the reference continuation, each token corrupted with prob ``corrupt``."""
    proposer, rng = eng.speculative.proposer, random.Random(seed)
    real = proposer.draft

    def draft(entries, kv):
        real(entries, kv)
        for e in entries:
            req, k = e.request, e.num_draft_tokens
            ref = reference.get(tuple(req.prompt_token_ids), [])
            have = req.num_output_tokens
            for i in range(k):
                tok = ref[have + i] if have + i < len(ref) else 7
                req.token_ids[e.start + 1 + i] = rng.randrange(3, 500) if rng.random() < corrupt else tok

    proposer.draft = draft
    return eng


def assert_same(got, want) -> None:
    for x, y in zip(got, want, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        if y.logprobs is not None:
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5
            for tx, ty in zip(x.top_logprobs, y.top_logprobs, strict=True):
                assert tx.keys() == ty.keys()


SEEDED = SamplingParams(max_tokens=40, temperature=0.8, seed=1234, ignore_eos=True, logprobs=2)
OTHERS = SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True)  # unseeded: the shared generator


def test_seeded_request_is_the_same_alone_batched_repeated_and_without_speculation(model):
    """The default engine (MTP on, 3 tokens, adaptive): the batch size and the engine-wide acceptance
    prior change which steps draft and with how many tokens, which must not change a seed's tokens."""
    prompt = ids(5, 23)
    others = [ids(10 + i, 7 + 5 * i) for i in range(5)]
    plain = generate(engine(model, speculative_tokens=0), [prompt], SEEDED)
    spec = engine(model)
    assert spec.speculative is not None and spec.speculative.draft_length.adaptive
    alone = generate(spec, [prompt], SEEDED)
    batched = generate(engine(model), others + [prompt], [OTHERS] * 5 + [SEEDED])
    assert_same(alone, plain)
    assert_same(batched[-1:], plain)
    for _ in range(3):  # the same engine, its acceptance prior and step gate moved on
        assert_same(generate(spec, [prompt], SEEDED), plain)
        assert_same(generate(spec, others + [prompt], [OTHERS] * 5 + [SEEDED])[-1:], plain)
    assert all(len(o.token_ids) == OTHERS.max_tokens for o in batched[:-1])
    assert spec.stats().spec_draft_tokens > 0


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_seeded_sampling_with_accepted_drafts_equals_plain_decoding(model, adaptive, k):
    """Oracle drafts, so every accepted length 0..k happens: tokens and logprobs are plain decoding's
    (top-k / top-p included), and the acceptance statistics count what was accepted."""
    prompts = [ids(60 + i, 3 + 6 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=32, temperature=t, top_p=tp, top_k=tk, seed=s, ignore_eos=True, logprobs=1)
              for t, tp, tk, s in ((0.8, 1.0, 0, 1), (1.3, 0.9, 0, 2), (0.6, 1.0, 20, 3), (1.0, 0.8, 50, 4))]
    ref = generate(engine(model, speculative_tokens=0), prompts, params)
    table = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    eng = with_oracle(engine(model, speculative_tokens=k, speculative_adaptive=adaptive), table, corrupt=0.25, seed=k)
    assert_same(generate(eng, prompts, params), ref)
    assert_same(generate(eng, prompts[::-1], params[::-1]), ref[::-1])  # another batch order, a warm prior
    for i in range(len(prompts)):  # each alone
        assert_same(generate(eng, prompts[i:i + 1], params[i]), ref[i:i + 1])
    s = eng.stats()
    hist = {int(a): n for a, n in s.spec_accepted_length.items()}
    assert s.spec_verify_steps == sum(hist.values()) > 0
    assert s.spec_accepted_tokens == sum(a * n for a, n in hist.items())
    assert hist[k] > 0 and s.spec_accepted_tokens > 0
    assert 0 < s.spec_acceptance_rate < 1


def test_unseeded_sampled_requests_decode_under_mtp(model):
    """Unseeded rows verify with the sampler's shared generator (on the sampler's device)."""
    prompts = [ids(80 + i, 4 + 3 * i) for i in range(3)]
    params = SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, ignore_eos=True)
    ref = generate(engine(model, speculative_tokens=0), prompts, params)
    table = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    eng = with_oracle(engine(model, speculative_adaptive=False), table, corrupt=0.0, seed=0)
    out = generate(eng, prompts, params)
    assert all(len(o.token_ids) == 25 and o.finish_reason == "length" for o in out)
    assert eng.stats().spec_verify_steps > 0


def test_verify_sampled_emits_the_plain_samplers_tokens_and_draws_one_row_per_token():
    """Against the plain sampler row by row: same tokens, and the generator ends where plain decoding
    of the emitted tokens leaves it, whatever the drafts."""
    torch.manual_seed(0)
    sampler = Sampler()
    rng = random.Random(0)
    for trial in range(200):
        k = rng.randrange(0, 5)
        vocab = rng.choice([5, 37, 300])
        logits = torch.randn(k + 1, vocab) * rng.choice([0.5, 2.0, 6.0])
        params = SamplingParams(temperature=rng.choice([0.3, 1.0, 1.7]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([0, 3, 50]), seed=trial)
        plain_g = params.make_generator()
        want = [sampler(logits[i:i + 1], [params], [plain_g]).token_ids[0] for i in range(k + 1)]
        # drafts: the plain tokens, one corrupted at a random position (or none)
        drafts = list(want[:k])
        cut = rng.randrange(0, k + 1)
        if cut < k:
            drafts[cut] = (drafts[cut] + 1 + rng.randrange(vocab - 1)) % vocab
        g = params.make_generator()
        out = verify_sampled(logits, drafts, params, g, sampler)
        assert out == want[:cut + 1]
        replay = params.make_generator()
        for i in range(len(out)):
            sampler(logits[i:i + 1], [params], [replay])
        assert torch.equal(g.get_state(), replay.get_state())
    # unseeded: the shared generator, on the sampler's device
    out = verify_sampled(torch.randn(3, 11), [1, 2], SamplingParams(temperature=1.0), None, sampler)
    assert 1 <= len(out) <= 3 and all(0 <= t < 11 for t in out)
