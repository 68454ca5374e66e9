"""vLLM's truncate_prompt_tokens through the OpenAI server (the demo checkpoint, in process): a
completion keeps its prompt's last k tokens (usage and echo say so, streamed or not), a chat without
media likewise; a chat whose cut would go through media is a 400 naming the field, as are 0 and -2."""

from __future__ import annotations

import base64
import json

import pytest

from tests.support.media_samples import image_bytes
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

PROMPT = "A red square and a blue circle are next to a green triangle"


def test_a_completion_keeps_the_last_tokens(demo_client, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 4}
    cut = demo_client.post("/v1/completions", json={**body, "echo": True}).json()
    alone = demo_client.post("/v1/completions", json={"prompt": ids[-4:], "max_tokens": 3, "temperature": 0,
                                                 "ignore_eos": True}).json()
    assert cut["usage"]["prompt_tokens"] == 4
    tail = tokenizer.decode(ids[-4:])
    assert cut["choices"][0]["text"] == tail + alone["choices"][0]["text"]
    with demo_client.stream("POST", "/v1/completions", json={**body, "echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == cut["choices"][0]["text"]
    whole = demo_client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 100, "echo": True}).json()
    assert whole["choices"][0]["text"].startswith(PROMPT)  # not cut: the prompt as given


def test_a_chat_without_media_is_cut_and_with_media_refused(demo_client):
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0}
    full = demo_client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
    cut = demo_client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 5}).json()
    assert full > 5 and cut["usage"]["prompt_tokens"] == 5
    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG")).decode()
    media = {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                               {"type": "text", "text": "What is it?"}]}]}
    r = demo_client.post("/v1/chat/completions", json={**media, "truncate_prompt_tokens": 5})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text
    assert demo_client.post("/v1/chat/completions", json={**media, "truncate_prompt_tokens": 100000}).status_code == 200


@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_bad_values_are_400s(demo_client, value):
    r = demo_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": value})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text


def test_a_text_longer_than_the_context_is_cut_not_refused(demo_client, demo_engine, tokenizer):
    """Only the text's tail is tokenized (bounded work), and its last tokens are those of the whole."""
    text = (PROMPT + ". ") * 500
    body = {"prompt": text, "max_tokens": 1, "temperature": 0}
    assert demo_client.post("/v1/completions", json=body).status_code == 400  # over the context
    keep = demo_engine.max_model_len - 1
    for k, n in ((-1, keep), (300, 300)):
        out = demo_client.post("/v1/completions", json={**body, "truncate_prompt_tokens": k, "echo": True}).json()
        assert out["usage"]["prompt_tokens"] == n
        assert out["choices"][0]["text"].startswith(tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[-n:]))


def test_a_chat_longer_than_the_context_is_cut_up_to_a_bound(demo_client, demo_engine):
    """A chat without media may render to 4 contexts (chat_preparation.TRUNCATABLE_CONTEXTS) before the
    engine cuts it; past that it is refused, naming the bound."""
    keep = demo_engine.max_model_len - 1
    chat = {"messages": [{"role": "user", "content": (PROMPT + ". ") * 150}], "max_tokens": 1, "temperature": 0}
    assert demo_client.post("/v1/chat/completions", json=chat).status_code == 400
    out = demo_client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": -1}).json()
    assert out["usage"]["prompt_tokens"] == keep
    huge = {**chat, "messages": [{"role": "user", "content": (PROMPT + ". ") * 2000}], "truncate_prompt_tokens": -1}
    r = demo_client.post("/v1/chat/completions", json=huge)
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text
