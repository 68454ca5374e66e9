"""vLLM's ``cache_salt`` through the OpenAI server (the demo checkpoint, in process, prefix caching
on by default): a repeated prompt reports cached tokens only under the salt it was first sent with,
a chat with media included, and its media hits the encoder cache only under that salt; the answer
does not change; a bad salt is a 400."""

from __future__ import annotations

import base64

import pytest

from tests.support.media_samples import image_bytes
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]


def cached(r) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_prefix_cache_is_shared_only_under_one_salt(demo_client):
    text = "Salted prompt: " + "a circle beside a square, " * 12
    body = {"prompt": text, "max_tokens": 3, "temperature": 0}
    first = demo_client.post("/v1/completions", json={**body, "cache_salt": "tenant-a-3f9c"})
    assert cached(first) == 0
    assert cached(demo_client.post("/v1/completions", json={**body, "cache_salt": "tenant-b-77e1"})) == 0
    assert cached(demo_client.post("/v1/completions", json=body)) == 0  # unsalted: a miss too
    again = demo_client.post("/v1/completions", json={**body, "cache_salt": "tenant-a-3f9c"})
    assert cached(again) > 0
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_a_chat_with_media_is_salted_too(demo_client):
    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG")).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe the salted image."}]}],
            "max_tokens": 2, "temperature": 0}
    assert cached(demo_client.post("/v1/chat/completions", json={**chat, "cache_salt": "s1-a8d2"})) == 0
    assert cached(demo_client.post("/v1/chat/completions", json={**chat, "cache_salt": "s2-0b4e"})) == 0
    assert cached(demo_client.post("/v1/chat/completions", json={**chat, "cache_salt": "s1-a8d2"})) > 0


def test_the_encoder_cache_is_shared_only_under_one_salt(demo_client, demo_engine):
    """A tenant cannot learn from encoder time either that another sent the same image: its media is
    keyed apart (X-Encoder-Cache-Hits counts the units taken from the encoder cache), and so are
    ingest's memos (a remembered data URL is neither decoded nor hashed again)."""
    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG", size=(96, 80))).decode()

    def ask(salt=None):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is this?"}]}],
                "max_tokens": 4, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        r = demo_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return int(r.headers["X-Encoder-Cache-Hits"]), r.json()["choices"][0]["message"]["content"]

    def memo_hits() -> int:
        return demo_engine.stats().media.get("source_memo_hits.image", 0)

    first = ask("enc-a-91c2")
    assert first[0] == 0
    hits = memo_hits()
    assert ask("enc-b-5d07")[0] == 0  # another tenant: encoded for it, not a hit
    assert ask()[0] == 0  # unsalted requests share among themselves, not with salted ones
    assert memo_hits() == hits  # nor did ingest remember the data URL across salts
    assert ask()[0] > 0 and memo_hits() == hits + 1
    again = ask("enc-a-91c2")
    assert again[0] > 0 and again[1] == first[1]  # the same tenant hits; the answer is the same
    assert memo_hits() == hits + 2


@pytest.mark.parametrize("salt", ["", 42, "x" * 2000])
def test_a_bad_salt_is_a_400(demo_client, salt):
    r = demo_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400 and "cache_salt" in r.text, r.text
