"""The demo tokenizer: byte-level BPE with merges learned from the demo corpus."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from samples.checkpoints.tiny_omni import build_tiny_tokenizer, learn_bpe_merges, tiny_special_tokens
from mm_pipeline.model.config import STRINGS
from samples.training.demo_tokenizer import VOCAB_SIZE, demo_corpus, demo_merges, demo_tokenizer


def test_learned_merges_are_a_pure_function_of_the_corpus():
    corpus = ["a red circle and a blue square", "beeps: low, high", "a square that is red, then blue"] * 4
    first = learn_bpe_merges(corpus, 50)
    assert first == learn_bpe_merges(list(corpus), 50)
    assert 0 < len(first) <= 50
    assert learn_bpe_merges(corpus, 3) == first[:3]  # greedy: a shorter budget is a prefix


def test_demo_tokenizer_keeps_special_ids_and_fits_the_vocab():
    special = tiny_special_tokens()
    tok = demo_tokenizer()
    plain = build_tiny_tokenizer(special)
    assert len(tok) <= VOCAB_SIZE and len(demo_merges()) > 0
    for name, tid in special.as_dict().items():
        assert tok.convert_tokens_to_ids(STRINGS[name]) == tid == plain.convert_tokens_to_ids(STRINGS[name])
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.convert_tokens_to_ids(tag) == plain.convert_tokens_to_ids(tag)


def test_demo_tokenizer_shortens_captions_to_words():
    tok = demo_tokenizer()
    for caption, n in [("a red circle and a blue square", 7), ("beeps: low, high, high", 7),
                       ("a square that is red, then blue, then green", 11)]:
        assert len(tok.encode(caption, add_special_tokens=False)) == n
    # Every corpus caption is one token per pre-tokenized word (" red", ",", " then", ...).
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in demo_corpus()[7:]:
        assert len(tok.encode(text, add_special_tokens=False)) == len(pre.pre_tokenize_str(text)), text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips(text):
    tok = demo_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
