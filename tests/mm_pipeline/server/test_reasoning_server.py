"""``--reasoning-parser`` through the real server (uvicorn on 127.0.0.1, raw HTTP): chat answers put
``<think>...</think>`` in ``reasoning_content``, streamed and not, each of ``n`` choices on its own.

The engine is scripted (a model that thinks on cue): it writes fixed texts, cut into deltas so that
the tags fall across them, with the demo model's tokenizer -- in whose vocabulary ``<think>`` and
``</think>`` are tokens (not special ones: they stay in the decoded text) -- for token ids, logprobs
and the ``auto`` decision; its first delta carries prompt ids as OmniEngine's does.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

import httpx
import pytest

from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server import ServerSettings, ServerThread, create_app

# choice -> its deltas' texts; the last one comes with the finished delta
THINKS = ["<thi", "nk>\nThe user", " asks 2+2.</th", "ink>", "\n\n", "It is", " 4."]  # both tags cut across deltas
PLAIN = ["Four", ", plainly", " <think> is only a word here."]  # no thinking: all content
OPENED = ["\nThe prompt", " opened it.</think>", "\n\nFour."]  # after a prompt ending in <think>
RAW = {name: "".join(script) for name, script in (("thinks", THINKS), ("plain", PLAIN), ("opened", OPENED))}


class ThinkingEngine:
    """OmniEngine's generate API over fixed answers: choice i of a request writes ``scripts[i]``,
    tokenized by ``encoder``, and ends with ``finish``; ``tokenizer`` is what the server sees (it
    decides ``auto`` by it)."""

    model_name = "thinker"

    def __init__(self, encoder: Any, scripts: list[list[str]], prompt: str, tokenizer: Any,
                 finish: str = "stop") -> None:
        self.encoder, self.tokenizer = encoder, tokenizer
        self.scripts = scripts
        self.finish = finish  # the finish_reason every answer ends with
        self.prompt_ids = encoder.encode(prompt, add_special_tokens=False)

    async def generate(self, messages: Any, params: Any, *, request_id: str = "r-0",
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[GenerationDelta]:
        script = self.scripts[int(request_id.rsplit("-", 1)[1]) % len(self.scripts)]
        done = 0
        for k, piece in enumerate(script):
            await asyncio.sleep(0.001)  # the n choices' deltas interleave
            ids = self.encoder.encode(piece, add_special_tokens=False)
            done += len(ids)
            lps = [-0.5] * len(ids) if params.logprobs is not None else None
            tops = [{i: -0.5} for i in ids] if params.logprobs is not None else None
            last = k == len(script) - 1
            yield GenerationDelta(request_id, ids, piece, lps, tops, last, self.finish if last else None,
                                  len(self.prompt_ids), done, 0, time.time(),
                                  prompt_token_ids=list(self.prompt_ids) if k == 0 else None)

    async def generate_prompt(self, prompt: Any, params: Any, *, request_id: str = "r-0",
                              priority: int = 0, cache_salt: str | None = None
                              ) -> AsyncIterator[GenerationDelta]:
        async for delta in self.generate([], params, request_id=request_id):
            yield delta

    def stats(self) -> dict:
        return {}


GENERATION_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def serve(tokenizer, tmp_path_factory):
    """``serve(scripts, reasoning_parser=..., prompt=..., tokenizer=...)`` -> base URL of a running server."""
    servers: list[ServerThread] = []

    def start(scripts: list[list[str]], reasoning_parser: str = "auto", prompt: str = GENERATION_PROMPT,
              engine_tokenizer: Any = tokenizer) -> str:
        engine = ThinkingEngine(tokenizer, scripts, prompt, engine_tokenizer)
        settings = ServerSettings(files_dir=str(tmp_path_factory.mktemp("files")), reasoning_parser=reasoning_parser)
        server = ServerThread(create_app(engine, settings)).start()
        servers.append(server)
        return server.base_url

    yield start
    for server in servers:
        server.stop()


def chat(base: str, **fields: Any) -> dict:
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], **fields}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(base: str, **fields: Any) -> list[dict]:
    """Every chunk's JSON, in order (the role chunks and the [DONE] left out)."""
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "stream": True, **fields}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return [c for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta"]]


def streamed(chunks: list[dict], index: int) -> dict[str, Any]:
    """One choice's stream put together: its text of each kind, its deltas, its finish_reason."""
    mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
    deltas = [c["delta"] for c in mine]
    return {"reasoning": "".join(d.get("reasoning_content") or "" for d in deltas),
            "content": "".join(d.get("content") or "" for d in deltas), "deltas": deltas,
            "finish_reason": mine[-1]["finish_reason"],
            "logprob_tokens": "".join(t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"])}


def test_a_non_streamed_answer_has_its_thinking_in_reasoning_content(serve, tokenizer):
    base = serve([THINKS])
    out = chat(base, logprobs=True)
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is 4.",
                                 "reasoning_content": "\nThe user asks 2+2."}
    # what the model wrote is untouched elsewhere: logprobs per token, usage, finish_reason
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == RAW["thinks"]
    assert out["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) == sum(
        len(tokenizer.encode(piece, add_special_tokens=False)) for piece in THINKS)
    assert choice["finish_reason"] == "stop"
    # a text completion is the raw continuation, as vLLM's (no parser on /v1/completions)
    r = httpx.post(base + "/v1/completions", json={"prompt": "What is 2+2?"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == RAW["thinks"]


def test_a_streamed_answer_sends_thinking_as_reasoning_deltas(serve):
    base = serve([THINKS])
    chunks = chat_stream(base, logprobs=True)
    got = streamed(chunks, 0)
    assert (got["reasoning"], got["content"]) == ("\nThe user asks 2+2.", "It is 4.")  # == not streamed
    assert got["finish_reason"] == "stop" and got["logprob_tokens"] == RAW["thinks"]
    for d in got["deltas"]:
        assert "<" not in (d.get("content") or "") + (d.get("reasoning_content") or "")  # no tag, whole or cut
        if d.get("reasoning_content"):
            assert "content" not in d  # a thinking chunk names no content, as vLLM's
        else:
            assert "reasoning_content" not in d and isinstance(d["content"], str)
    # the deltas that held only part of a tag still went out, for their logprobs
    assert len(got["deltas"]) == len(THINKS)


def test_each_of_n_choices_parses_its_own_text(serve):
    """Choice 0 thinks, choice 1 does not: one parser state each, streamed and not."""
    base = serve([THINKS, PLAIN])
    whole = chat(base, n=2)["choices"]
    assert [c["message"]["reasoning_content"] for c in whole] == ["\nThe user asks 2+2.", None]
    assert [c["message"]["content"] for c in whole] == ["It is 4.", RAW["plain"]]
    chunks = chat_stream(base, n=2)
    for c in whole:
        got = streamed(chunks, c["index"])
        assert got["reasoning"] == (c["message"]["reasoning_content"] or "")
        assert got["content"] == c["message"]["content"]
        assert got["finish_reason"] == "stop"


def test_a_prompt_that_opened_think_makes_the_start_reasoning(serve):
    """A template that writes <think> into the generation prompt: the output has only </think>."""
    base = serve([OPENED], prompt=GENERATION_PROMPT + "<think>")
    assert chat(base)["choices"][0]["message"] == {"role": "assistant", "content": "Four.",
                                                   "reasoning_content": "\nThe prompt opened it."}
    got = streamed(chat_stream(base), 0)
    assert (got["reasoning"], got["content"]) == ("\nThe prompt opened it.", "Four.")
    closed = serve([OPENED])  # the same text after a prompt that did not open it: all content
    assert chat(closed)["choices"][0]["message"]["content"] == RAW["opened"]


def test_reasoning_parser_none_keeps_the_tags_in_content(serve):
    base = serve([THINKS, PLAIN], reasoning_parser="none")
    whole = chat(base, n=2)["choices"]
    assert [c["message"]["content"] for c in whole] == [RAW["thinks"], RAW["plain"]]
    assert all(c["message"]["reasoning_content"] is None for c in whole)
    chunks = chat_stream(base, n=2)
    for index, raw in ((0, RAW["thinks"]), (1, RAW["plain"])):
        got = streamed(chunks, index)
        assert got["content"] == raw and not any("reasoning_content" in d for d in got["deltas"])


class Untagged:
    """A vocabulary without the tags (all the server reads of a tokenizer to decide ``auto``)."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b": 1}


def test_auto_leaves_a_model_without_the_tag_tokens_alone(serve):
    """No <think> / </think> tokens in the vocabulary: auto is off, a forced qwen3 still parses."""
    tokenizer = Untagged()
    off = serve([THINKS], engine_tokenizer=tokenizer)
    assert chat(off)["choices"][0]["message"] == {"role": "assistant", "content": RAW["thinks"],
                                                  "reasoning_content": None}
    forced = serve([THINKS], reasoning_parser="qwen3", engine_tokenizer=tokenizer)
    assert chat(forced)["choices"][0]["message"]["reasoning_content"] == "\nThe user asks 2+2."


def test_a_batch_lines_chat_answer_is_split_as_the_server_splits_it(tokenizer, tmp_path):
    """``mmserve batch`` answers a line as the server would: ``--reasoning-parser`` (BatchConfig's
    ``reasoning_parser``, default auto) applies to its chat answers too."""
    from mm_pipeline.jobs.batch import BatchJob

    src, body = tmp_path / "in.jsonl", {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    engine = ThinkingEngine(tokenizer, [THINKS], GENERATION_PROMPT, tokenizer)
    for parser, reasoning, content in (("auto", "\nThe user asks 2+2.", "It is 4."), ("none", None, RAW["thinks"])):
        out = tmp_path / f"out-{parser}.jsonl"
        asyncio.run(BatchJob(engine, reasoning_parser=parser).run(src, out))
        message = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        BatchJob(engine, reasoning_parser="deepseek")
