"""Stop conditions of LLM.generate: stop token ids and stop strings, incremental (a string split
over tokens or over a multi-byte character stops where a full decode per token would) and with
bounded detokenizer work per token."""

from __future__ import annotations

import pytest

from llm_core import SamplingParams
from tests.llm_core.engine.test_llm_generate import ckpt, engine, ids, model  # noqa: F401 -- fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


class CharTokenizer:
    """Token t decodes to chr(ord('a') + t % 26): enough for stop-string tests."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_stop_token_ids_and_stop_strings(model):
    prompt = ids(70, 12)
    free = engine(model).generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    toks = free.token_ids
    stop_tok = engine(model).generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                               stop_token_ids=[toks[5]]))[0]
    first = toks.index(toks[5])
    assert stop_tok.finish_reason == "stop" and stop_tok.token_ids == toks[: first + 1]
    text = CharTokenizer().decode(toks)
    stop_str = text[6:8]
    cut = text.find(stop_str)
    out = engine(model, tokenizer=CharTokenizer()).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_str]))[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.token_ids == toks[: cut + 2]
    # vLLM's include_stop_str_in_output: the same tokens, the text up to the end of the stop string
    kept = engine(model, tokenizer=CharTokenizer()).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_str],
                                 include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == text[:cut + 2] and kept.token_ids == out.token_ids


def test_the_token_that_ends_generation_is_not_text(model):
    """As in vLLM: a stop token id (or EOS) that ends the output stays in token_ids, not in the text,
    unless include_stop_str_in_output keeps it; a stop token that comes before a stop string is
    completed ends it the same way (the stop string is never left in the text)."""
    prompt = ids(72, 12)
    tok = CharTokenizer()
    toks = engine(model).generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    end = toks[6]
    k = toks.index(end) + 1
    for extra in ({}, {"stop": [tok.decode([end])]}, {"stop": [tok.decode(toks[k - 2:k])]}):
        out = engine(model, tokenizer=tok).generate(
            [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[end], **extra))[0]
        assert out.finish_reason == "stop" and out.token_ids == toks[:k]
        assert out.text == tok.decode(toks[:k - 1]), extra
    kept = engine(model, tokenizer=tok).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[end],
                                 include_stop_str_in_output=True))[0]
    assert kept.token_ids == toks[:k] and kept.text == tok.decode(toks[:k])
    # EOS: the model's own end token, whatever skip_special_tokens says
    with_eos = engine(model, tokenizer=tok)
    with_eos.engine.admission.eos_token_ids = (end,)
    eos = with_eos.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, skip_special_tokens=False))[0]
    assert eos.finish_reason == "stop" and eos.token_ids == toks[:k] and eos.text == tok.decode(toks[:k - 1])


class ByteTokenizer:
    """Token t decodes to one UTF-8 byte of a text with 2- and 3-byte characters (replacement
    characters where bytes do not form one): multi-byte characters split over tokens."""

    BYTES = "héllo wörld → ok ✓ ".encode()

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(self.BYTES[t % len(self.BYTES)] for t in token_ids).decode("utf-8", errors="replace")


class CountingTokenizer(CharTokenizer):
    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        self.lengths.append(len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


def test_stop_strings_over_split_characters_equal_a_full_decode_per_token(model):
    """The engine's incremental stop check stops at the token and cuts the text where decoding the
    whole output after every token would."""
    tok = ByteTokenizer()
    prompt = ids(71, 12)
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    toks = engine(model).generate([prompt], SamplingParams(**params))[0].token_ids
    text = tok.decode(toks)
    for stops in ([text[9:11]], [text[20:23], text[30:31]], [text[4:6], "never"]):
        k = next(k for k in range(1, len(toks) + 1) if any(s in tok.decode(toks[:k]) for s in stops))
        seen = tok.decode(toks[:k])
        out = engine(model, tokenizer=tok).generate([prompt], SamplingParams(**params, stop=stops))[0]
        assert out.finish_reason == "stop" and out.token_ids == toks[:k]
        assert out.text == seen[:min(seen.find(s) for s in stops if s in seen)]


def test_stop_check_decodes_a_bounded_window_per_token(model):
    """Per step the engine decodes the new token with one token of context, however long the output
    is; the whole output is decoded once, when the request finishes."""
    tok = CountingTokenizer()
    out = engine(model, tokenizer=tok).generate(
        [ids(72, 10)], SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, stop=["#never#"]))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 150
    *steps, final = tok.lengths
    assert final == 150 and max(steps) <= 2 and len(steps) <= 2 * 150
