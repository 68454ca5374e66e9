"""The reasoning parser (mm_pipeline/prompt/reasoning.py) on its own: the decisions of its table,
streamed == not streamed for any text cut anywhere (hypothesis), what it holds back, how it reads
the vocabulary and the prompt, and the setting / flag that turn it on."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline import cli
from mm_pipeline.prompt.reasoning import (ReasoningParser, ReasoningSplit, ThinkSyntax, resolve_reasoning,
                                          split_reasoning)
from mm_pipeline.server.launch.serve_settings import server_settings
from mm_pipeline.server.responses import Delta
from mm_pipeline.server.settings import ServerSettings
from tests.support.paths import DEMO_MODEL

START, END = "<think>", "</think>"

#  output                                    prompt opened <think>  reasoning              content
EXAMPLES = [
    ("<think>\nR\n</think>\n\nThe answer.",   False,                "\nR\n",                "The answer."),
    ("<think>R</think>A",                     False,                "R",                    "A"),
    ("\n \n<think>R</think> \t\nA \n",        False,                "R",                    "A \n"),
    ("The answer.",                           False,                "",                     "The answer."),
    ("  The answer.",                         False,                "",                     "  The answer."),
    ("<think>R, cut by max_tokens",           False,                "R, cut by max_tokens", ""),
    ("<think>R</thi",                         False,                "R</thi",               ""),
    ("<thi",                                  False,                "",                     "<thi"),
    ("<thinking>A",                           False,                "",                     "<thinking>A"),
    ("R</think>A",                            False,                "",                     "R</think>A"),
    ("A <think>B</think>C",                   False,                "",                     "A <think>B</think>C"),
    ("<think>R</think>A</think>B<think>C",    False,                "R",                    "A</think>B<think>C"),
    ("<think></think>\n\n",                   False,                "",                     ""),
    ("R</think>\n\nA",                        True,                 "R",                    "A"),
    ("R, cut by max_tokens",                  True,                 "R, cut by max_tokens", ""),
    ("<think>R</think>A",                     True,                 "R",                    "A"),
    ("\nR</think>A",                          True,                 "\nR",                  "A"),
    ("</think>A",                             True,                 "",                     "A"),
]


@pytest.mark.parametrize("text, opened, reasoning, content", EXAMPLES)
def test_the_documented_decisions(text, opened, reasoning, content):
    assert split_reasoning(text, in_reasoning=opened) == ReasoningSplit(reasoning, content)


@pytest.mark.parametrize("text, opened, reasoning, content", EXAMPLES)
def test_the_examples_fed_a_character_at_a_time(text, opened, reasoning, content):
    parser = ReasoningParser(in_reasoning=opened)
    out = ReasoningSplit()
    for ch in text:
        out += parser.feed(ch)
    assert out + parser.finish() == ReasoningSplit(reasoning, content)


# text made mostly of the pieces that matter: tags, their halves, whitespace; plus any text at all
_PIECES = st.sampled_from([START, END, "<", "</", "<th", "think", ">", "/", "\n", "\n\n", " ", "\t", "a", "bc",
                           "<thi", "</thi", "nk>", "ink>", "é", "💡"])
_TEXTS = st.one_of(st.lists(_PIECES, max_size=24).map("".join), st.text(max_size=60))


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=600, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=12), opened=st.booleans())
def test_streamed_equals_whole_text_for_any_cut(text, cuts, opened):
    """Concatenated deltas == the one-shot answer, and what is held between deltas is bounded: never
    more than leading whitespace with a prefix of <think>, or a possible start of </think>. Emitted
    text is never taken back, so a partial </think> never goes out as text of either kind."""
    parser = ReasoningParser(in_reasoning=opened)
    out = ReasoningSplit()
    for chunk in _chunks(text, cuts):
        out += parser.feed(chunk)
        held = parser.held
        assert START.startswith(held.lstrip()) or (len(held) < len(END) and END.startswith(held)), held
    assert out + parser.finish() == split_reasoning(text, in_reasoning=opened)


@settings(max_examples=300, deadline=None)
@given(reasoning=st.text(max_size=30).filter(lambda r: END not in r),
       answer=st.text(max_size=30), gap=st.sampled_from(["", "\n", "\n\n", " \n "]))
def test_a_well_formed_answer_round_trips(reasoning, answer, gap):
    """<think>R</think> + whitespace + A gives back R and A (A without its leading whitespace)."""
    assert split_reasoning(f"{START}{reasoning}{END}{gap}{answer}") == ReasoningSplit(reasoning, answer.lstrip())


def test_a_tag_cut_across_deltas_is_held_until_decided():
    parser = ReasoningParser()
    assert parser.feed("<th") == ReasoningSplit() and parser.held == "<th"
    assert parser.feed("ink>Let me see</th") == ReasoningSplit(reasoning="Let me see")
    assert parser.held == "</th"  # neither reasoning nor content yet
    assert parser.feed("ink>") == ReasoningSplit() and parser.held == ""
    assert parser.feed("\n\n") == ReasoningSplit()  # whitespace after </think>: dropped, not held
    assert parser.feed("Four.") == ReasoningSplit(content="Four.")
    assert parser.finish() == ReasoningSplit()
    held = ReasoningParser()
    assert held.feed("<think>x</thi") == ReasoningSplit(reasoning="x")
    assert held.feed("s is not a tag") == ReasoningSplit(reasoning="</this is not a tag")


# ---- the vocabulary and the prompt ----------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer():
    from llm_core.llm import load_tokenizer

    return load_tokenizer(DEMO_MODEL)


def test_the_demo_tokenizer_keeps_the_tags_in_decoded_text(demo_tokenizer):
    """Why the server parses text: <think> / </think> are added tokens that are not special, so
    skip_special_tokens leaves them in the text the engine decodes."""
    ids = demo_tokenizer.encode("<think>\nhmm\n</think>\n\nA.", add_special_tokens=False)
    assert (ids[0], demo_tokenizer.convert_tokens_to_ids(END)) == (268, 269) and 269 in ids
    assert demo_tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nhmm\n</think>\n\nA."
    syntax = ThinkSyntax.of_tokenizer(demo_tokenizer)
    assert (syntax.start_id, syntax.end_id) == (268, 269)
    assert 268 not in syntax.special_ids and demo_tokenizer.convert_tokens_to_ids("<|im_start|>") in syntax.special_ids


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),  # the demo template: the model opens it
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),  # a template that opens it
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think></think>", False),  # enable_thinking off
    ("<|im_start|>user\nsay <think><|im_end|>\n<|im_start|>assistant\n", False),  # a user's text spelling it
    ("<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>", True),
    ("<think>", True), ("", False),
])
def test_the_prompt_tells_whether_the_output_starts_inside_think(demo_tokenizer, prompt, opened):
    syntax = ThinkSyntax.of_tokenizer(demo_tokenizer)
    ids = demo_tokenizer.encode(prompt, add_special_tokens=False)
    assert syntax.prompt_opens_thinking(ids) is opened
    expected = ReasoningSplit("R", "A") if opened else ReasoningSplit(content="R</think>A")
    assert syntax.parser(syntax.prompt_opens_thinking(ids)).parse("R</think>A") == expected


class _Vocab:
    """A tokenizer with a vocabulary of its own (``get_vocab`` is all the parser reads)."""

    def __init__(self, *tokens: str) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_auto_is_on_only_for_a_vocabulary_with_both_tags(demo_tokenizer):
    assert resolve_reasoning("auto", demo_tokenizer) == ThinkSyntax.of_tokenizer(demo_tokenizer) is not None
    for tokenizer in (None, _Vocab("a", "b"), _Vocab("<think>", "x")):  # no tags, or one of them only
        assert resolve_reasoning("auto", tokenizer) is None
        assert resolve_reasoning("qwen3", tokenizer) == ThinkSyntax()  # forced: the tags are found in the text
    assert resolve_reasoning("none", demo_tokenizer) is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, qwen3, none; got 'deepseek'"):
        resolve_reasoning("deepseek", demo_tokenizer)


def test_the_setting_and_its_flag(tmp_path, capsys):
    assert ServerSettings().reasoning_parser == "auto"
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, qwen3, none; got 'on'"):
        ServerSettings(reasoning_parser="on")  # type: ignore[arg-type]
    parsed = server_settings(cli.parse_args(["serve", "--model", "m", "--reasoning-parser", "none"]), tmp_path)
    assert parsed.reasoning_parser == "none"
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"reasoning_parser": "qwen3"}))
    assert server_settings(cli.parse_args(["serve", "--model", "m", "--config", str(path)]),
                               tmp_path).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["serve", "--model", "m", "--reasoning-parser", "deepseek_r1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--reasoning-parser: expected one of auto, qwen3, none, got 'deepseek_r1'" in err


def test_chunk_deltas_name_only_what_they_carry():
    assert Delta.of_text("think", "").model_dump() == {"reasoning_content": "think"}  # as vLLM: no content key
    assert Delta.of_text("", "answer").model_dump() == {"content": "answer"}  # the parser off: as before
    assert Delta.of_text("", "").model_dump() == {"content": ""}  # logprobs / finish_reason only: as before
    assert Delta.of_text("a", "b").model_dump() == {"content": "b", "reasoning_content": "a"}
    assert Delta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


TEXTS = {0: " ", 1: "<think>", 2: "</think>", 5: "a", 6: "b", 7: "c", 8: "beeps", 9: "x"}  # by id


@pytest.mark.parametrize("ids, opened, thinking", [
    ([1, 5, 6, 7, 2, 9, 9], False, 3),   # <think> 5 6 7 </think> answer
    ([0, 1, 5, 6, 2, 9], False, 2),      # leading whitespace before <think>
    ([0, 0, 1, 5, 2, 9], False, 1),      # more of it: the parser still opens
    ([8, 1, 5, 6, 2, 9], False, 0),      # a word before <think>: the tag is content, as the parser reads it
    ([5, 6, 2, 9], True, 2),             # the prompt opened <think>
    ([1, 5, 6, 7], False, 3),            # cut short: thinking to the end
    ([5, 6], True, 2),
    ([9, 9, 9], False, 0),               # no thinking at all
    ([2, 9], True, 0),                   # opened and closed at once
])
def test_reasoning_tokens_are_those_between_the_tags(ids, opened, thinking):
    syntax = ThinkSyntax(start_id=1, end_id=2)
    text = "".join(TEXTS[i] for i in ids)
    assert syntax.reasoning_tokens(ids, text, opened) == thinking
    split = syntax.parser(opened).parse(text)  # the count follows the parser: thinking iff it found some
    assert (thinking > 0) == bool(split.reasoning)
    assert ThinkSyntax().reasoning_tokens(ids, text, opened) == 0  # tags that are no tokens: not countable by id
