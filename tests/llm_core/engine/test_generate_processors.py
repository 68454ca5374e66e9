"""End to end: LLM.generate with min_p, min_tokens, logit_bias and the penalties == transformers
generate with its logits processors (greedy, the tiny checkpoint); a batch mixing requests with and
without them gives each the tokens it gets alone; bad logit_bias ids fail the request alone."""

from __future__ import annotations

import pytest
import torch

from llm_core import ErrorKind, SamplingParams
from tests.llm_core.engine.test_llm_generate import ckpt, engine, hf_model, ids, model  # noqa: F401 -- fixtures

transformers = pytest.importorskip("transformers")
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2  # the tiny checkpoint's


class OpenAIPenalties(LogitsProcessor):
    """Hand-computed reference: presence / frequency penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=scores.shape[1]).to(scores.dtype)
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def hf_tokens(hf, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_and_logit_bias_match_transformers(model, hf_model):
    prompts = [ids(101, 9), ids(102, 23)]
    free = engine(model).generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for p, f in zip(prompts, free):
        bias = {f.token_ids[1]: -30.0, f.token_ids[3]: -5.0, 77: 4.0}
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, logit_bias=bias)
        out = engine(model).generate([p], sp)[0]
        ref = hf_tokens(hf_model, p, 24, repetition_penalty=1.8, sequence_bias={(t,): b for t, b in bias.items()})
        assert out.token_ids == ref
        assert out.token_ids != f.token_ids  # the processors did change the answer


def test_presence_and_frequency_penalties_match_a_hand_computed_reference(model, hf_model):
    p = ids(103, 15)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7)
    out = engine(model).generate([p], sp)[0]
    ref = hf_tokens(hf_model, p, 30, logits_processor=LogitsProcessorList([OpenAIPenalties(len(p), 1.5, 0.7)]))
    assert out.token_ids == ref
    plain = engine(model).generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids != plain.token_ids


def test_min_tokens_holds_back_eos_and_stop_ids_as_transformers(model, hf_model):
    p = ids(104, 11)
    # EOS pushed to the top: without min_tokens it is the first token
    sp = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={EOS: 100})
    assert engine(model).generate([p], sp)[0].token_ids == [EOS]
    sp = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={EOS: 100}, min_tokens=6)
    out = engine(model).generate([p], sp)[0]
    ref = hf_tokens(hf_model, p, 20, sequence_bias={(EOS,): 100.0}, min_new_tokens=6, eos_token_id=EOS)
    assert out.token_ids == ref and len(ref) == 7 and ref[-1] == EOS and out.finish_reason == "stop"
    # a stop token id is held back too; with ignore_eos EOS is just a token (vLLM)
    stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[77],
                          logit_bias={77: 100}, min_tokens=4)
    out = engine(model).generate([p], stop)[0]
    assert out.token_ids[-1] == 77 and len(out.token_ids) == 5 and out.finish_reason == "stop"
    eos_free = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={EOS: 100}, min_tokens=3)
    assert engine(model).generate([p], eos_free)[0].token_ids == [EOS] * 5


def test_min_tokens_holds_back_stop_strings(model):
    from tests.llm_core.engine.test_stop_strings import CharTokenizer

    p = ids(105, 10)
    free = engine(model).generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    text = CharTokenizer().decode(free.token_ids)
    stop = text[1]  # a one-character stop string found at token 1 at the latest
    first = text.find(stop)
    llm = engine(model, tokenizer=CharTokenizer())
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert len(out.token_ids) == first + 1
    held = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                            min_tokens=4))[0]
    later = text.find(stop, 4)  # the first occurrence past min_tokens tokens
    assert held.token_ids == (free.token_ids[:later + 1] if later >= 0 else free.token_ids)
    assert len(held.token_ids) > 4


def test_mixed_batch_equals_each_alone(model):
    prompts = [ids(110 + i, n) for i, n in enumerate((5, 17, 9, 30, 12, 3))]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, logit_bias={9: 3}),
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, min_p=0.1, presence_penalty=0.8),
        SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True, top_k=20),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, frequency_penalty=-0.5, min_tokens=10,
                       logit_bias={EOS: 50}, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=2, ignore_eos=True, logprobs=1),
    ]
    batched = engine(model).generate(prompts, params)
    for p, sp, b in zip(prompts, params, batched):
        alone = engine(model).generate([p], sp)[0]
        assert b.token_ids == alone.token_ids
        if sp.logprobs is not None:
            assert b.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len(batched[4].token_ids) == 10  # EOS held back all the way


def test_greedy_and_seeded_runs_repeat(model):
    p = ids(120, 14)
    for sp in (SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, min_p=0.2),
               SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True, frequency_penalty=1.0,
                              min_p=0.05, logit_bias={3: 2})):
        assert engine(model).generate([p], sp)[0].token_ids == engine(model).generate([p], sp)[0].token_ids


def test_logit_bias_outside_the_vocabulary_fails_that_request_alone(model):
    llm = engine(model)
    good = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=3, temperature=0.0, logit_bias={512: 1.0})
    outs = llm.generate([ids(130, 5), ids(131, 5)], [good, bad])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 3
    assert outs[1].finish_reason == "error" and outs[1].error_kind is ErrorKind.INVALID_INPUT
    assert "logit_bias" in outs[1].error and "512" in outs[1].error


def test_fixed_shape_decode_steps_process_logits_as_the_plain_path(model):
    """The fixed-shape decode path (fixed_decode/decode_graphs.py) gives the same logits rows; the
    processing happens after it, so its tokens are the plain path's."""
    from tests.llm_core.engine.test_decode_graphs import engine as graph_engine

    prompts = [ids(140 + i, n) for i, n in enumerate((9, 30, 17))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.7),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=1, frequency_penalty=1.0, min_tokens=12,
                             logit_bias={EOS: 60}, min_p=0.05)]
    plain = graph_engine(model).generate(prompts, params)
    llm = graph_engine(model, mode="eager")
    graphs, calls = llm.engine.runner.decode_graphs, []
    real = graphs.forward
    graphs.forward = lambda entries, kv: calls.append(len(entries)) or real(entries, kv)
    fixed = llm.generate(prompts, params)
    assert [o.token_ids for o in fixed] == [o.token_ids for o in plain]
    assert calls  # the fixed-shape path ran the decode steps


class OnlyThese(LogitsProcessor):
    """Hand-computed reference for allowed_token_ids: every other token -> -inf."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = sorted(allowed)

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.allowed] = 0
        return scores + keep


class WordTokenizer:
    """encode() of the bad-words test: a word as written and after a space, as fixed ids."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text, add_special_tokens=False):
        return self.table[text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def test_allowed_token_ids_and_bad_words_match_transformers(model, hf_model):
    p = ids(105, 13)
    free = engine(model).generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    allowed = {free[2], free[5], 77, 90}
    out = engine(model).generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     allowed_token_ids=sorted(allowed)))[0]
    assert out.token_ids == hf_tokens(hf_model, p, 20, logits_processor=LogitsProcessorList([OnlyThese(allowed)]))
    assert set(out.token_ids) <= allowed
    # a one-token word as written, a two-token one after a space: transformers' bad_words_ids bans the same
    words = WordTokenizer({"w": [free[1]], " w": [free[3], free[4]]})
    out = engine(model, tokenizer=words).generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                      bad_words=["w"]))[0]
    assert out.token_ids == hf_tokens(hf_model, p, 20, bad_words_ids=[[free[1]], [free[3], free[4]]])
    assert out.token_ids != free and free[1] not in out.token_ids
    # sampled: still only the allowed ids
    sampled = engine(model).generate([p], SamplingParams(max_tokens=30, temperature=1.5, seed=3, ignore_eos=True,
                                                         allowed_token_ids=[7, 8, 9]))[0]
    assert set(sampled.token_ids) <= {7, 8, 9}


def test_allowed_ids_past_the_vocabulary_and_bad_words_without_a_tokenizer_fail_alone(model):
    llm = engine(model)
    outs = llm.generate([ids(106, 5)] * 3, [SamplingParams(max_tokens=3, allowed_token_ids=[5, 10**6]),
                                            SamplingParams(max_tokens=3, bad_words=["x"]),
                                            SamplingParams(max_tokens=3, temperature=0.0)])
    assert outs[0].finish_reason == "error" and "allowed_token_ids" in outs[0].error
    assert outs[0].error_kind == ErrorKind.INVALID_INPUT
    assert outs[1].finish_reason == "error" and "bad_words need a tokenizer" in outs[1].error
    assert outs[2].finish_reason == "length"
    with pytest.raises(ValueError, match="allowed_token_ids must hold"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must be"):
        SamplingParams(bad_words=["x" * 257])


def test_constraints_that_exclude_every_token_fail_that_request_alone_as_invalid_input(model):
    """allowed_token_ids = [EOS] while min_tokens holds EOS back: no token may come next. The request
    ends as invalid input naming its constraints (not an internal error after a forbidden token was
    sampled), greedy or sampled; the batch's other requests go on with the tokens they get alone."""
    llm = engine(model)
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alone = llm.generate([ids(140, 6)], good)[0]
    for temperature in (0.0, 0.8):
        dead = SamplingParams(max_tokens=4, temperature=temperature, allowed_token_ids=[EOS], min_tokens=2)
        outs = llm.generate([ids(140, 6), ids(141, 6)], [good, dead])
        assert outs[0].token_ids == alone.token_ids and outs[0].finish_reason == "length"
        assert outs[1].finish_reason == "error" and outs[1].error_kind is ErrorKind.INVALID_INPUT
        assert "allowed_token_ids and min_tokens" in outs[1].error and not outs[1].token_ids
