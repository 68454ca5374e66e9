"""The token that ends an answer on the demo checkpoint: EOS (``<|im_end|>``) or a stop token id stays
in the usage count but not in the text, streamed or not, with ``skip_special_tokens`` off too (as vLLM);
``include_stop_str_in_output`` keeps it."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]
ASK = {"messages": [{"role": "user", "content": "Describe this: a square that is red, then blue"}],
       "max_tokens": 60, "temperature": 0.0, "skip_special_tokens": False}


def answer(client, **fields) -> tuple[str, str, str]:
    """The plain answer's content and finish_reason, and the streamed content joined."""
    got = client.post("/v1/chat/completions", json={**ASK, **fields})
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json={**ASK, **fields, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return choice["message"]["content"], choice["finish_reason"], streamed


def test_the_end_token_is_not_text_unless_asked(demo_client, tokenizer):
    text, reason, streamed = answer(demo_client)
    assert reason == "stop" and text and "<|im_end|>" not in text and streamed == text
    kept, _, kept_streamed = answer(demo_client, include_stop_str_in_output=True)
    assert kept == kept_streamed == text + "<|im_end|>"
    # a stop token id of an ordinary token: the text ends before it
    ids = tokenizer.encode(text, add_special_tokens=False)
    end = ids[len(ids) // 2]
    cut, reason, cut_streamed = answer(demo_client, stop_token_ids=[end])
    assert reason == "stop" and cut == cut_streamed
    assert cut == tokenizer.decode(ids[:ids.index(end)], skip_special_tokens=False)
