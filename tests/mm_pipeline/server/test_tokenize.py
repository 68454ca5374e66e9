"""vLLM's utility endpoints (mm_pipeline/server/tokenize/routes.py) against the demo checkpoint served in
process, with an API key: ``POST /tokenize`` (text form: the tokenizer's ids; chat form: exactly the
prompt ids the engine runs for the same /v1/chat/completions request -- template fields and media
placeholders included -- and its ``usage.prompt_tokens``, with no encoder run), ``POST /detokenize``
(round trip, special tokens kept), ``GET /version``; each bad input is a 4xx naming the problem, and
all three need the key.
"""

from __future__ import annotations

import base64
import time
from importlib import metadata

import httpx
import pytest
from fastapi.testclient import TestClient

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

KEY = "sk-tokenize"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = {"role": "user", "content": "Tell me a story."}
TEXT = "Hello world: <|im_start|> stays text, and so does <think>."


@pytest.fixture(scope="module")
def engine(demo_engine):
    return demo_engine


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    app = create_app(engine, ServerSettings(api_key=KEY, files_dir=str(tmp_path_factory.mktemp("files"))))
    with ServerThread(app) as served:
        yield served


@pytest.fixture
def submitted(engine, monkeypatch):
    """The prompt ids of every request the engine is handed, as it is handed them."""
    got: list[list[int]] = []
    submit = engine.runtime.submit

    def recording(request_id, token_ids, *args, **kwargs):
        got.append(list(token_ids))
        return submit(request_id, token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.runtime, "submit", recording)
    return got


def post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def chat(server, messages: list[dict], **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, **fields}
    return post(server, "/v1/chat/completions", body)


def media_part(kind: str) -> dict:
    if kind == "image":
        data = base64.b64encode((SAMPLE_MEDIA / "image_000001.png").read_bytes()).decode()
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    if kind == "audio":
        data = base64.b64encode((SAMPLE_MEDIA / "audio_000003.wav").read_bytes()).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    data = base64.b64encode((SAMPLE_MEDIA / "video_sound_000000.mp4").read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{data}"}}


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message


# ---- text form ----------------------------------------------------------------------------------------
def test_text_is_the_tokenizers_ids(server, engine, tokenizer):
    r = post(server, "/tokenize", {"prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(TEXT)["input_ids"] == tokenizer.encode(TEXT, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == engine.max_model_len
    assert body["token_strs"] is None
    plain = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "model": engine.model_name})
    assert plain.json()["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)


def test_token_strs_on_request(server, tokenizer):
    body = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_text_equals_the_prompt_a_completion_runs(server, submitted):
    r = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    tokens = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert submitted == [tokens] and r.json()["usage"]["prompt_tokens"] == len(tokens)


# ---- chat form ----------------------------------------------------------------------------------------
PAST = [USER, {"role": "assistant", "content": "Once.", "reasoning_content": "Keep it short."},
        {"role": "user", "content": "Another one."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLED = [USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]


@pytest.mark.parametrize("messages,fields", [
    ([USER], {}),
    ([USER], {"add_generation_prompt": False}),
    ([USER], {"chat_template_kwargs": {"enable_thinking": False}}),
    ([USER, {"role": "assistant", "content": "Once upon"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ([{"role": "system", "content": "Be brief."}, *PAST], {}),
    (CALLED, {"tools": TOOLS}),
], ids=["default", "no-generation-prompt", "enable-thinking-false", "continue-final-message", "history", "tools"])
def test_chat_is_the_prompt_the_engine_runs(server, tokenizer, submitted, messages, fields):
    answer = chat(server, messages, **fields)
    assert answer.status_code == 200, answer.text
    r = post(server, "/tokenize", {"messages": messages, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    assert submitted == [body["tokens"]]
    assert body["count"] == len(body["tokens"]) == answer.json()["usage"]["prompt_tokens"]
    # and it is the template's prompt (test_template_options.py compares it with transformers)
    assert tokenizer.decode(body["tokens"]).startswith("<|im_start|>")
    if "tools" in fields:  # rendered: the definitions, the call, the tool's answer
        text = tokenizer.decode(body["tokens"])
        assert "<tools>\n<function>\n<name>get_weather</name>" in text
        assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in text
        assert "<tool_response>rain</tool_response>" in text


def test_template_fields_change_the_chat_ids(server):
    def ids(**fields):
        return post(server, "/tokenize", {"messages": [USER], **fields}).json()["tokens"]

    default, bare = ids(), ids(add_generation_prompt=False)
    assert len(bare) < len(default) and default[:len(bare)] == bare  # the assistant header is the difference
    assert len(ids(chat_template_kwargs={"enable_thinking": False})) == len(default) + 2  # <think></think>


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_media_placeholders_are_expanded_as_the_engine_expands_them(server, engine, tokenizer, submitted, kind):
    """The prompt laid out with each item's placeholders sized (media planned: sizes from headers, a
    probe, decoded audio), and no encoder run for it."""
    messages = [{"role": "user", "content": [media_part(kind), {"type": "text", "text": "Describe it."}]}]
    encoded = dict(engine.runtime.batcher.stats())
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    assert dict(engine.runtime.batcher.stats()) == encoded, "tokenize ran an encoder"
    tokens = r.json()["tokens"]
    answer = chat(server, messages)
    assert answer.status_code == 200, answer.text
    assert submitted == [tokens] and answer.json()["usage"]["prompt_tokens"] == len(tokens)
    assert dict(engine.runtime.batcher.stats()) != encoded  # (the chat did: the check above can fail)
    # again, now from the cache's manifest and units: the same ids
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == tokens
    pads = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}[kind]
    assert tokenizer.decode(tokens).count(pads) > 1  # expanded: one pad per row the encoder fills


@pytest.mark.parametrize("kinds", [("image",), ("video",), ("image", "video")],
                         ids=["image-one-hop", "video-one-hop", "image-and-video"])
def test_cached_media_is_tokenized_from_its_manifest_alone(server, engine, submitted, monkeypatch, kinds):
    """Once a chat has been served its media's rows are in the encoder cache; /tokenize of the same
    chat sizes the media from the manifests alone: the same ids, and no row read (megabytes for a
    long video) nor counted as an encoder-cache hit. One item takes the one-hop path
    (plan_warm), two the usual one (plan)."""
    messages = [{"role": "user", "content": [*map(media_part, kinds), {"type": "text", "text": "Describe it."}]}]
    answer = chat(server, messages)
    assert answer.status_code == 200, answer.text
    cache, planner = engine.runtime.cache, engine.runtime.planner
    lookups: list[int] = []
    lookup = planner.producer.lookup
    monkeypatch.setattr(planner.producer, "lookup", lambda units: lookups.append(len(units)) or lookup(units))
    before, unit_hits = cache.stats(), planner.counts.get("unit_hits", 0)
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == submitted[0] and len(submitted) == 1
    after = cache.stats()
    assert lookups == [] and planner.counts.get("unit_hits", 0) == unit_hits, "tokenize read cached rows"
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert after["manifest_hits"] == before["manifest_hits"] + len(kinds)  # sized from the manifests
    # the same chat again reads the rows (the checks above can fail), and runs the same ids
    assert chat(server, messages).status_code == 200 and submitted[1] == submitted[0]
    assert lookups and sum(cache.stats()["hits"].values()) > sum(after["hits"].values())


@pytest.mark.parametrize("name", ["audio_000001.flac", "video_000001.webm"])
def test_tokenizing_media_leaves_nothing_held(server, engine, name):
    """Planning decodes an audio clip (its log-mels counted in the decode budget until encoded or
    dropped) and may start an early decode: a /tokenize drops its plans, and with them every byte
    and the admission slot (fresh media, so the planner decodes it rather than reading a manifest)."""
    budget = engine.runtime.planner.producer.budget
    kind = "audio" if name.startswith("audio") else "video"
    data = base64.b64encode((SAMPLE_MEDIA / name).read_bytes()).decode()
    part = ({"type": "input_audio", "input_audio": {"data": data, "format": "flac"}} if kind == "audio" else
            {"type": "video_url", "video_url": {"url": f"data:video/webm;base64,{data}"}})
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    deadline = time.monotonic() + 10
    while (budget.in_use or engine.requests_in_flight) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (budget.in_use, budget.early_in_use, engine.requests_in_flight) == (0, 0, 0)


def test_media_errors_are_a_requests_errors(server):
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}}
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": [bad]}]})
    assert 400 <= r.status_code < 500 and r.json()["error"]["kind"] == "media", r.text
    missing = {"type": "file", "file": {"file_id": "file-nope"}}
    assert_error(post(server, "/tokenize", {"messages": [{"role": "user", "content": [missing]}]}), 404, "file-nope")


# ---- detokenize ---------------------------------------------------------------------------------------
def test_detokenize_round_trip(server, tokenizer):
    tokens = post(server, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    templated = post(server, "/tokenize", {"messages": [USER]}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": templated, "model": "demo-model"}).json()["prompt"]
    assert text == tokenizer.decode(templated) and "<|im_start|>user" in text  # special tokens kept
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens,words", [
    ([1, -1], ("tokens[1]", "negative")),
    ([5, 336], ("tokens[1]", "out of the vocabulary", "0 to 335")),
    ([10 ** 30], ("tokens[0]", "out of the vocabulary")),
    ([1] * 2049, ("2049", "max_model_len")),
], ids=["negative", "past-the-vocabulary", "huge", "longer-than-the-context"])
def test_detokenize_refuses_what_is_not_a_token_id(server, engine, tokens, words):
    assert engine.max_model_len == 2048 and len(engine.tokenizer) == 336  # the cases are sized for these
    r = post(server, "/detokenize", {"tokens": tokens})
    assert_error(r, 400, *words)
    assert r.json()["error"]["param"] == "tokens"


# ---- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,status,words", [
    ("/tokenize", {"prompt": "a", "messages": [USER]}, 400, ("exactly one of prompt",)),
    ("/tokenize", {}, 400, ("exactly one of prompt",)),
    ("/tokenize", {"prompt": 5}, 400, ("prompt",)),
    ("/tokenize", {"messages": "hi"}, 400, ("messages",)),
    ("/tokenize", {"messages": []}, 400, ("messages",)),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, ("role",)),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "maybe"}, 400, ("add_special_tokens",)),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, 400, ("add_generation_prompt", "chat form")),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"enable_thinking": False}}, 400, ("chat_template_kwargs",)),
    ("/tokenize", {"messages": [USER], "add_special_tokens": True}, 400, ("add_special_tokens",)),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, ("tools", "chat form")),
    ("/tokenize", {"messages": [USER], "continue_final_message": True}, 400, ("continue_final_message",)),
    ("/tokenize", {"messages": [USER], "chat_template_kwargs": {"no_such_variable": 1}}, 400, ("no_such_variable",)),
    ("/tokenize", {"messages": [USER], "chat_template_kwargs": {"messages": []}}, 400, ("messages",)),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, ("gpt-4",)),
    ("/tokenize", {"messages": [USER], "model": "gpt-4"}, 404, ("gpt-4",)),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, ("gpt-4",)),
    ("/detokenize", {}, 400, ("tokens",)),
    ("/detokenize", {"tokens": [1.0]}, 400, ("tokens",)),
    ("/detokenize", {"tokens": ["1"]}, 400, ("tokens",)),
    ("/detokenize", {"tokens": [True]}, 400, ("tokens",)),
    ("/detokenize", {"tokens": "1 2"}, 400, ("tokens",)),
])
def test_bad_input_is_a_4xx_naming_it(server, path, body, status, words):
    r = post(server, path, body)
    assert_error(r, status, *words)
    if status == 404:
        assert r.json()["error"]["code"] == "model_not_found"


def test_a_prompt_over_the_context_is_refused_as_a_chat_is(server):
    long = "word " * 5000
    for body in ({"prompt": long}, {"messages": [{"role": "user", "content": long}]}):
        r = post(server, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_invalid_json_and_an_oversize_body(engine, tmp_path):
    app = create_app(engine, ServerSettings(max_request_bytes=1024, files_dir=str(tmp_path)))
    with TestClient(app) as client:
        for path in ("/tokenize", "/detokenize"):
            assert_error(client.post(path, content=b"{not json"), 400, "not valid JSON")
        assert_error(client.post("/tokenize", json={"prompt": "x" * 2000}), 413, "1024-byte limit")
        assert_error(client.post("/detokenize", json={"tokens": [1] * 600}), 413, "1024-byte limit")


# ---- /version, the key, the schema --------------------------------------------------------------------
def test_version_is_the_package_version(server):
    r = httpx.get(server.base_url + "/version", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": metadata.version("mmserve")}


@pytest.mark.parametrize("method,path,body", [("POST", "/tokenize", {"prompt": "a"}),
                                              ("POST", "/detokenize", {"tokens": [1]}),
                                              ("GET", "/version", None)])
def test_the_api_key_is_needed(server, method, path, body):
    url = server.base_url + path
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.request(method, url, json=body, headers=AUTH, timeout=30).status_code == 200
    scrape = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    assert f'endpoint="{path}",status="401"' in scrape and f'endpoint="{path}",status="200"' in scrape


def test_the_schema_documents_the_routes(server):
    paths = httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()["paths"]
    assert paths["/tokenize"]["post"]["requestBody"] and paths["/detokenize"]["post"]["requestBody"]
    assert "application/json" in paths["/version"]["get"]["responses"]["200"]["content"]
