"""Logits processing in the sampler (logits_processing.py ``process_logits`` / ``Sampler.probs``): min_p,
min_tokens, logit_bias, presence / frequency / repetition penalties -- validation naming the field,
equivalence with transformers' logits processors, row independence, raw logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llm_core.engine.sampling import Sampler, SamplingParams
from llm_core.engine.sampling.params import MAX_LOGIT_BIAS
from llm_core.engine.sampling.logits_processing import process_logits

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor)

V = 64


@dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = (2,)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def hist(seed: int, n_prompt: int = 12, n_out: int = 9) -> History:
    g = torch.Generator().manual_seed(seed)
    return History(torch.randint(0, V, (n_prompt,), generator=g).tolist(),
                   torch.randint(0, V, (n_out,), generator=g).tolist())


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={" 5": 1}), "logit_bias"),
    (dict(logit_bias={"\u0665": 1}), "logit_bias"), (dict(logit_bias={"9" * 5000: 1}), "logit_bias"),
    (dict(logit_bias={"99999999999": 1}), "logit_bias"), (dict(logit_bias={5: True}), "logit_bias"),
    (dict(logit_bias={"5": 1, 5: 2}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
])
def test_invalid_values_raise_value_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_defaults_process_nothing_and_logit_bias_is_stored_as_sorted_pairs():
    assert not SamplingParams().processes_logits
    assert not SamplingParams(min_p=0.5).processes_logits  # min_p lives in probs(), draft-safe
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (7, 1.0)) and p.processes_logits
    assert p == SamplingParams(logit_bias=[(7, 1), (3, -2.5)])
    assert hash(p) == hash(SamplingParams(logit_bias={3: -2.5, 7: 1}))
    for kw in (dict(min_tokens=1), dict(presence_penalty=0.1), dict(frequency_penalty=-0.1),
               dict(repetition_penalty=1.1)):
        assert SamplingParams(**kw).processes_logits


@pytest.mark.parametrize("min_p,temp", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)])
def test_min_p_equals_transformers_after_temperature(min_p, temp):
    x = logits(3, 1)
    ours = Sampler.probs(x.clone(), [SamplingParams(min_p=min_p, temperature=temp)] * 3)
    ref = torch.softmax(MinPLogitsWarper(min_p)(None, x / temp), dim=-1)
    torch.testing.assert_close(ours, ref)


def test_min_p_sampling_stays_in_the_kept_set():
    x = logits(1, 2) / 3
    keep = torch.softmax(x, -1)[0] >= 0.2 * torch.softmax(x, -1)[0].max()
    s = Sampler(seed=0)
    p = SamplingParams(min_p=0.2)
    toks = {s(x, [p], [None]).token_ids[0] for _ in range(200)}
    assert toks <= set(keep.nonzero()[:, 0].tolist()) and 1 < len(toks) and keep.sum() < V / 2


@pytest.mark.parametrize("rp", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(rp):
    x, hs = logits(2, 3), [hist(1), hist(2)]
    ours = process_logits(x, [SamplingParams(repetition_penalty=rp)] * 2, hs)
    ids = torch.tensor([h.prompt_token_ids + h.output_token_ids for h in hs])
    torch.testing.assert_close(ours, RepetitionPenaltyLogitsProcessor(rp)(ids, x.clone()))


def test_min_tokens_equals_transformers_and_honours_ignore_eos():
    x = logits(1, 4)
    h = History([5, 6, 7], [9, 10])  # 2 tokens out
    p = SamplingParams(min_tokens=3, stop_token_ids=[11, 12])
    ours = process_logits(x, [p], [h])
    ref = MinNewTokensLengthLogitsProcessor(3, min_new_tokens=3, eos_token_id=[2, 11, 12])(
        torch.tensor([h.prompt_token_ids + h.output_token_ids]), x.clone())
    torch.testing.assert_close(ours, ref)
    ignore = process_logits(x, [SamplingParams(min_tokens=3, stop_token_ids=[11], ignore_eos=True)], [h])
    assert ignore[0, 11] == float("-inf") and ignore[0, 2] == x[0, 2]  # EOS is no stop under ignore_eos
    done = process_logits(x, [p], [History([5], [9, 10, 11])])  # 3 out: nothing masked any more
    torch.testing.assert_close(done, x)


def test_logit_bias_equals_transformers_sequence_bias():
    x = logits(1, 5)
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    ours = process_logits(x, [SamplingParams(logit_bias=bias)], None)  # history-free: no histories needed
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2]]), x.clone())
    torch.testing.assert_close(ours, ref)
    with pytest.raises(ValueError, match="logit_bias"):
        process_logits(x, [SamplingParams(logit_bias={V: 1.0})], None)


def test_presence_and_frequency_penalties_hand_computed():
    x, h = logits(1, 6), History([1, 1, 1, 4], [3, 3, 5, 3])
    ours = process_logits(x, [SamplingParams(presence_penalty=0.5, frequency_penalty=-1.5)], [h])
    ref = x.clone()
    for t, n in {3: 3, 5: 1}.items():
        ref[0, t] -= 0.5 + (-1.5) * n
    torch.testing.assert_close(ours, ref)  # prompt tokens (1, 4) untouched: OpenAI's penalties see the output


def test_order_is_bias_then_penalties_as_vllm():
    x = torch.zeros(1, V)
    x[0, 3] = -1.0
    h = History([3], [])
    out = process_logits(x, [SamplingParams(logit_bias={3: 3.0}, repetition_penalty=2.0)], [h])
    assert out[0, 3].item() == pytest.approx(1.0)  # (-1 + 3) / 2, not -1 * 2 + 3


def test_rows_are_processed_independently_and_other_rows_untouched():
    x = logits(4, 7)
    hs = [hist(10 + i) for i in range(4)]
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.4, logit_bias={1: 2}),
              SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=1.0, min_tokens=50, max_tokens=60)]
    before = x.clone()
    batch = process_logits(x, params, hs)
    torch.testing.assert_close(x, before)  # the input keeps its raw rows
    for i in range(4):
        torch.testing.assert_close(batch[i:i + 1], process_logits(x[i:i + 1], [params[i]], [hs[i]]))
    assert torch.equal(batch[0], x[0]) and torch.equal(batch[2], x[2])
    assert process_logits(x, [SamplingParams()] * 4, None) is x  # nothing to do: the same tensor


def test_greedy_follows_processed_logits_and_logprobs_stay_raw():
    x = logits(2, 8)
    top = int(x[0].argmax())
    p = SamplingParams(temperature=0.0, logit_bias={top: -100}, logprobs=1)
    out = Sampler(seed=0)(x, [p, SamplingParams(temperature=0.0, logprobs=1)], [None, None], [hist(1), hist(2)])
    second = int(x[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    assert out.token_ids[0] == second != top
    raw = torch.log_softmax(x, -1)
    assert out.logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert out.top_logprobs[0] == pytest.approx({top: raw[0, top].item()}, abs=1e-6)
    assert out.token_ids[1] == int(x[1].argmax())


def test_seeded_rows_with_penalties_do_not_depend_on_batch_company():
    x = logits(3, 9)
    hs = [hist(20 + i) for i in range(3)]
    p = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.5, presence_penalty=1.0, min_p=0.05)
    alone = Sampler(seed=1)(x[1:2], [p], [p.make_generator()], [hs[1]]).token_ids
    g = p.make_generator()
    batch = Sampler(seed=2)(x, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.0)],
                            [None, g, None], hs).token_ids
    assert batch[1] == alone[0]


def test_history_dependent_rows_need_histories():
    with pytest.raises(ValueError, match="histories"):
        process_logits(logits(1), [SamplingParams(repetition_penalty=1.2)], None)
