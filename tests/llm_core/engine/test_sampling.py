"""Sampling: parameter validation, greedy, top-k/top-p support, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.engine.sampling import Sampler, SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=10**30), "top_k"),
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(top_p=True), "top_p"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(stop=[""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=1000), "logprobs"),
    ],
)
def test_invalid_params_raise_value_error_naming_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_normalise_lists_and_single_stop_string():
    p = SamplingParams(stop="END", stop_token_ids=[5, 6])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    hash(p)  # frozen and hashable


def _draw(sampler, logits, params, n, seed=None):
    gens = [p.make_generator() for p in params]
    return [sampler(logits, params, gens).token_ids for _ in range(n)]


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler(seed=1)
    out = s(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    out = s(logits, [SamplingParams(temperature=1.3, top_k=1)] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 1.0), st.integers(0, 1000))
def test_samples_stay_inside_top_k_and_top_p_sets(k, p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 16, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_k=k, top_p=p, seed=seed)
    scaled = torch.softmax(logits[0] / 0.7, -1)
    order = scaled.argsort(descending=True)
    allowed_k = set(order[:k].tolist())
    # nucleus over the top-k renormalised distribution: smallest prefix reaching mass p
    pk = scaled[order[:k]] / scaled[order[:k]].sum()
    n_keep = int((pk.cumsum(0) - pk < p).sum())
    allowed = set(order[:n_keep].tolist()) & allowed_k
    s = Sampler()
    gen = params.make_generator()
    for _ in range(40):
        tok = s(logits, [params], [gen]).token_ids[0]
        assert tok in allowed


def test_temperature_sampling_matches_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, seed=3)
    gen = params.make_generator()
    s = Sampler()
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[s(logits, [params], [gen]).token_ids[0]] += 1
    expected = torch.softmax(logits[0], -1)
    # 4 sigma of a binomial proportion at n=4000 is < 0.032
    assert torch.allclose(counts / n, expected, atol=0.032)


def test_seeded_rows_do_not_depend_on_batch_company():
    vocab = 40
    g = torch.Generator().manual_seed(7)
    row = torch.randn(1, vocab, generator=g)
    others = torch.randn(3, vocab, generator=g)
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    alone = _draw(Sampler(seed=0), row, [p], 20)
    mixed_params = [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    batch = torch.cat([others[:1], row, others[1:]])
    mixed = _draw(Sampler(seed=99), batch, mixed_params, 20)
    assert [m[1] for m in mixed] == [a[0] for a in alone]


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.5, logprobs=0, seed=1),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params, [p.make_generator() for p in params])
    lp = torch.log_softmax(logits, -1)
    for i in range(2):
        assert out.logprobs[i] == pytest.approx(lp[i, out.token_ids[i]].item(), abs=1e-6)
    top = out.top_logprobs[0]
    assert list(top.keys()) == lp[0].topk(3).indices.tolist()
    assert list(top.values()) == pytest.approx(lp[0].topk(3).values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == {}
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="sampler got logits"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None])


def test_top_k_over_the_vocabulary_keeps_every_token():
    logits = torch.randn(1, 50).repeat(2, 1)
    params = [SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=1), SamplingParams(temperature=1.0, seed=1)]
    out = Sampler()(logits, params, [p.make_generator() for p in params])
    assert out.token_ids[0] == out.token_ids[1]  # same seed, same distribution: top_k beyond V is no filter


def test_sample_isolated_fails_only_the_bad_row_and_keeps_seeded_draws():
    logits = torch.randn(3, 50)
    good = [SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.9, seed=6)]
    bad = SamplingParams(temperature=0.9, seed=7)
    object.__setattr__(bad, "logprobs", 10**6)  # past validation: topk over the vocabulary raises
    expected = Sampler()(logits[[0, 2]], good, [p.make_generator() for p in good]).token_ids
    params = [good[0], bad, good[1]]
    out, failed = Sampler().sample_isolated(logits, params, [p.make_generator() for p in params])
    assert list(failed) == [1] and isinstance(failed[1], RuntimeError)
    assert [out.token_ids[0], out.token_ids[2]] == expected and out.token_ids[1] == -1
