"""Where a chat the parser refuses says the problem is: every ``InvalidMessageError`` of
``parse_messages`` carries a location (``loc``, a ``Where``) that its message starts with, spelled as
the request spells it, so the server can name it in ``param`` and the Responses API can rename it
to its input items (tests/mm_pipeline/server/test_responses_store.py); the location survives a
pickle (a Ray replica's error reaches the ingress pickled)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.errors import InvalidMessageError, Where
from mm_pipeline.prompt.messages import parse_messages

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6),
                    st.sampled_from(["ftp://x/a.png", "data:,", "user", "assistant", "image_url", "function"]))
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "video_url", "refusal",
                                                      "file", "audio_codes", "bogus"])},
                             optional={"text": SCALARS, "image_url": st.one_of(SCALARS, st.fixed_dictionaries(
                                           {"url": SCALARS})), "video_url": st.fixed_dictionaries({"url": SCALARS}),
                                       "input_audio": st.one_of(SCALARS, st.fixed_dictionaries({"data": SCALARS})),
                                       "refusal": SCALARS, "file": st.one_of(SCALARS, st.dictionaries(
                                           st.sampled_from(["file_id", "file_data"]), SCALARS, max_size=2)),
                                       "audio_codes": st.one_of(SCALARS, st.fixed_dictionaries(
                                           {"codes": st.one_of(SCALARS, st.lists(st.lists(
                                               st.one_of(st.integers(-2, 2**33), st.text(max_size=2)), max_size=3),
                                               max_size=3))}))})
CALL = st.one_of(SCALARS, st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.one_of(
    SCALARS, st.fixed_dictionaries({"name": SCALARS, "arguments": st.one_of(SCALARS, st.sampled_from(
        ["{", "[]", '{"a": 1}', "{}"]))}))}))
MESSAGE = st.one_of(SCALARS, st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"])},
    optional={"content": st.one_of(SCALARS, st.lists(st.one_of(PART, SCALARS), max_size=3)),
              "tool_calls": st.one_of(SCALARS, st.lists(CALL, max_size=2)), "reasoning_content": SCALARS,
              "reasoning": SCALARS, "refusal": SCALARS, "name": SCALARS}))


@settings(max_examples=400, deadline=None)
@given(st.one_of(SCALARS, st.lists(MESSAGE, max_size=4)))
def test_every_refusal_starts_with_the_location_it_carries(messages):
    try:
        parse_messages(messages)
    except InvalidMessageError as exc:
        assert exc.loc and exc.loc[0] == "messages", str(exc)
        assert str(exc).startswith(str(exc.loc)), (str(exc), exc.loc)
        indexes = [p for p in exc.loc if isinstance(p, int)]
        assert not indexes or 0 <= indexes[0] < len(messages)


@pytest.mark.parametrize("messages, loc", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/a.png"}}]}],
     ("messages", 0, "content", 0, "image_url", "url")),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], ("messages", 1, "role")),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     ("messages", 0, "tool_calls", 0)),
    ([], ("messages",)),
])
def test_a_refusal_names_its_place(messages, loc):
    with pytest.raises(InvalidMessageError) as caught:
        parse_messages(messages)
    assert caught.value.loc == loc and str(caught.value).startswith(str(Where(loc)))
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.loc == loc and isinstance(again.loc, Where) and str(again) == str(caught.value)


def test_where_spells_as_the_request_does():
    assert str(Where(("messages", 2, "content", 0, "image_url", "url"))) == "messages[2].content[0].image_url.url"
    assert Where(("input",)).then(3, "output", 0) == ("input", 3, "output", 0) and str(Where(())) == ""
