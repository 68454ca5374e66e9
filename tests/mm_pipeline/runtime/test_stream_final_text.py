"""The streamed text of a request ends with the engine's final text: a stop string that spans two
steps with nothing before it (final text "") sends nothing, not the held-back start of the stop
string; an output the engine did not decode (text None) is decoded on the stream's side."""

from __future__ import annotations

import asyncio

from llm_core import SamplingParams
from llm_core.engine.outputs import RequestOutput
from mm_pipeline.runtime.omni_engine import OmniEngine


class CharTokenizer:
    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def streamed(outputs: list[RequestOutput], params: SamplingParams) -> list[str]:
    eng = OmniEngine.__new__(OmniEngine)  # _deltas needs only the tokenizer
    eng.tokenizer = CharTokenizer()

    async def deltas() -> list[str]:
        async def outs():
            for o in outputs:
                yield o
        return [d.new_text async for d in eng._deltas(outs(), params)]

    return asyncio.run(deltas())


def steps(tokens: list[int], final_text: str | None, reason: str) -> list[RequestOutput]:
    outs = [RequestOutput("r", [1], token_ids=tokens[:i + 1], new_token_ids=[t]) for i, t in enumerate(tokens)]
    last = outs[-1]
    last.finished, last.finish_reason, last.text = True, reason, final_text
    return outs


def test_stop_string_with_nothing_before_it_sends_nothing():
    params = SamplingParams(max_tokens=10, stop=["ck"])
    # "c" then "k": the engine cut the output before "ck", leaving ""
    assert "".join(streamed(steps([2, 10], "", "stop"), params)) == ""


def test_stop_string_after_text_sends_only_the_text_before_it():
    params = SamplingParams(max_tokens=10, stop=["ck"])
    assert "".join(streamed(steps([0, 1, 2, 10], "ab", "stop"), params)) == "ab"


def test_output_the_engine_did_not_decode_is_decoded_whole():
    params = SamplingParams(max_tokens=3, stop=["zz"])  # holds one character back while streaming
    assert "".join(streamed(steps([0, 1, 2], None, "length"), params)) == "abc"


class ByteTokenizer:
    """Ids >= 200 are byte tokens of multi-byte characters: alone each reads U+FFFD, as in a
    byte-level BPE vocabulary."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join("\ufffd" if t >= 200 else chr(ord("a") + t % 26) for t in token_ids)


def test_top_logprobs_of_tokens_that_read_alike_keep_every_entry():
    from mm_pipeline.server.completions.choices import TokenStrings

    eng = OmniEngine.__new__(OmniEngine)
    eng.tokenizer = ByteTokenizer()
    top = {0: -0.1, 201: -2.0, 202: -3.0, 203: -4.0}
    out = RequestOutput("r", [1], token_ids=[0], new_token_ids=[0], logprobs=[-0.1], top_logprobs=[top],
                        finished=True, finish_reason="length", text="a")

    async def deltas():
        async def outs():
            yield out
        return [d async for d in eng._deltas(outs(), SamplingParams(max_tokens=1, logprobs=4))]

    (delta,) = asyncio.run(deltas())
    strings = TokenStrings(ByteTokenizer())
    chat = strings.chat_logprobs(delta.new_token_ids, delta.logprobs, delta.top_logprobs).content[0]
    assert [(t.token, t.logprob) for t in chat.top_logprobs] == [
        ("a", -0.1), ("\ufffd", -2.0), ("\ufffd", -3.0), ("\ufffd", -4.0)]
    # the legacy completions format keys by text: the most likely of the alike tokens is kept
    legacy = strings.completion_logprobs(delta.new_token_ids, delta.logprobs, delta.top_logprobs)
    assert legacy.top_logprobs == [{"a": -0.1, "\ufffd": -2.0}]
