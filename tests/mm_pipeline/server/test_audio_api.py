"""OpenAI's audio API (``/v1/audio/transcriptions``, ``/v1/audio/translations``) on the demo checkpoint,
in process: the answer is the chat answer to the same audio and instruction (json, text and
streamed alike), the OpenAI SDK's ``audio.transcriptions.create`` works against it, and bad forms,
files and sizes are 4xx naming the problem."""

from __future__ import annotations

import base64
import json

import pytest

from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA
from tests.support.served import served_client

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

CLIP = SAMPLE_MEDIA / "audio_000002.mp3"
INSTRUCTION = "Transcribe the speech in this audio word for word."  # ServerSettings' default


def form(**fields) -> dict:
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}


def transcribe(client, path=CLIP, route="transcriptions", **fields):
    return client.post(f"/v1/audio/{route}", files={"file": (path.name, path.read_bytes())},
                       data=form(max_completion_tokens=12, **fields))


def chat_answer(client, path, text: str) -> dict:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(),
                                                   "format": path.suffix[1:]}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part, {
        "type": "text", "text": text}]}], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_transcription_is_the_chat_answer_in_every_format(demo_client):
    want = chat_answer(demo_client, CLIP, INSTRUCTION)
    r = transcribe(demo_client)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == want["choices"][0]["message"]["content"] and body["text"]
    assert body["usage"] == {"type": "tokens", "input_tokens": want["usage"]["prompt_tokens"],
                             "output_tokens": want["usage"]["completion_tokens"],
                             "total_tokens": want["usage"]["total_tokens"]}
    text = transcribe(demo_client, response_format="text")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert text.text == body["text"]
    with demo_client.stream("POST", "/v1/audio/transcriptions", files={"file": (CLIP.name, CLIP.read_bytes())},
                            data=form(max_completion_tokens=12, stream=True, stream_include_usage=True)) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    assert all(e["object"] == "transcription.chunk" for e in events)
    assert "".join(c["delta"]["content"] for e in events for c in e["choices"]) == body["text"]
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == want["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == body["usage"]["output_tokens"]


def test_language_prompt_and_translation_shape_the_instruction(demo_client):
    hinted = INSTRUCTION + " The speech is in de. Earlier text or words to expect: beeps"
    want = chat_answer(demo_client, CLIP, hinted)["choices"][0]["message"]["content"]
    assert transcribe(demo_client, language="de", prompt="beeps").json()["text"] == want
    english = "Translate the speech in this audio into English."
    want = chat_answer(demo_client, CLIP, english)["choices"][0]["message"]["content"]
    r = transcribe(demo_client, route="translations")
    assert r.status_code == 200 and r.json()["text"] == want


def test_the_openai_sdk_transcribes(demo_client):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(demo_client.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0)
    with CLIP.open("rb") as f:
        got = client.audio.transcriptions.create(model="demo-model", file=f, extra_body={"max_completion_tokens": 12})
    assert got.text == transcribe(demo_client).json()["text"]


@pytest.mark.parametrize("fields, status, words", [
    ({"response_format": "srt"}, 400, "timestamps"),
    ({"response_format": "verbose_json"}, 400, "timestamps"),
    ({"timestamp_granularities[]": "word"}, 400, "timestamp_granularities"),
    ({"timestamp_granularities[]": ""}, 400, "timestamp_granularities"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"language": "english please"}, 400, "language"),
    ({"model": "some-other-model"}, 404, "some-other-model"),
    ({"priority": "3"}, 400, "priority"),
])
def test_bad_fields_are_4xx_naming_them(demo_client, fields, status, words):
    r = transcribe(demo_client, **fields)
    assert r.status_code == status and words in r.text, r.text


def test_bad_files_and_bodies(demo_client, demo_engine, tmp_path_factory):
    r = demo_client.post("/v1/audio/transcriptions", data=form(model="x"))  # urlencoded, no file at all
    assert r.status_code == 415, r.text
    r = demo_client.post("/v1/audio/transcriptions", files={"other": ("a.txt", b"x")}, data=form(language="en"))
    assert r.status_code == 400 and "'file'" in r.text, r.text
    r = demo_client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"")})
    assert r.status_code == 400 and "empty" in r.text, r.text
    r = demo_client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF....WAVEfmt " + b"\x00" * 64)})
    assert 400 <= r.status_code < 500, r.text  # undecodable audio: the media pipeline's 4xx
    # named by the form's field, not by the chat the route answers it as
    assert r.json()["error"]["param"] == "file" and r.json()["error"]["message"].startswith("file: "), r.text
    r = demo_client.post("/v1/audio/transcriptions", files={"file": ("a.txt", b"plain text, not audio " * 8)})
    assert r.status_code == 415 and r.json()["error"]["param"] == "file", r.text
    assert "messages[" not in r.text, r.text
    assert transcribe(demo_client).status_code == 200  # and the server goes on

    with served_client(demo_engine, str(tmp_path_factory.mktemp("f")), max_audio_upload_bytes=4096) as c:
        r = transcribe(c)
        assert r.status_code == 413 and "4096" in r.text, r.text
