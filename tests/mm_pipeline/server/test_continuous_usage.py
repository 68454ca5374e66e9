"""vLLM's ``stream_options.continuous_usage_stats`` on the demo checkpoint: with ``include_usage``
every chunk carries the usage so far -- the prompt from the first chunk on, the completion tokens
growing to the final usage chunk's -- for chat (``n`` 2) and text completions (two prompts); without
``include_usage`` it changes nothing."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def chunks(client, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def check_running_usage(got: list[dict]) -> None:
    *running, last = got
    assert last["choices"] == [] and running
    final = last["usage"]
    completion = [c["usage"]["completion_tokens"] for c in running]
    assert completion == sorted(completion) and completion[-1] == final["completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in running} == {final["prompt_tokens"]}
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in running)


def test_chat_chunks_carry_the_usage_so_far(demo_client):
    body = {"messages": [{"role": "user", "content": "Describe a red square."}], "max_tokens": 8, "n": 2,
            "ignore_eos": True, "stream_options": CONTINUOUS}
    got = chunks(demo_client, "/v1/chat/completions", body)
    check_running_usage(got)
    assert got[-1]["usage"]["completion_tokens"] == 16
    plain = chunks(demo_client, "/v1/chat/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)  # without include_usage: no usage anywhere, as before


def test_completion_chunks_count_every_prompt(demo_client):
    body = {"prompt": ["Hello there", "A much longer prompt than the first one"], "max_tokens": 5,
            "ignore_eos": True, "stream_options": CONTINUOUS}
    got = chunks(demo_client, "/v1/completions", body)
    check_running_usage(got)
    assert got[-1]["usage"]["completion_tokens"] == 10
