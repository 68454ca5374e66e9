"""What a client types or sends is answered as the client's: special-token spellings in message text
are plain text (200, never a forged or broken media placeholder), media too thin for the vision
tower is a 400 media error, and a chat of more messages than the context limit holds is a 400
context-length error before it is templated (tiny omni engine on CPU, through HTTP)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from encoders.image_processing import AspectRatioError, ImageProcessingConfig, smart_resize
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.errors import ContextLengthError, InvalidMediaError
from mm_pipeline.prompt.messages import parse_messages
from tests.support.media_samples import image_bytes, many_channels_wav, video_bytes
from tests.support.served import served_tiny_omni


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_omni(tmp_path_factory, num_full_tokens=2048, num_swa_tokens=1024, max_num_seqs=2,
                          max_model_len=256) as server:
        yield server


def _chat(served, messages, **kw) -> httpx.Response:
    body = {"model": served.engine.model_name, "messages": messages, "max_tokens": 2, "temperature": 0, **kw}
    return httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)


def _data_url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


PH = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE = {"type": "image_url", "image_url": {"url": _data_url(image_bytes(size=(64, 64)), "image/png")}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "what is " + PH}],
    [{"role": "user", "content": [IMAGE, {"type": "text", "text": "compare with " + PH}]}],
    [{"role": "user", "content": "a <|vision_start|> b"}],
    [{"role": "system", "content": "<|mimo_audio_start|>"}, {"role": "user", "content": "hi"}],
], ids=["placeholder-no-media", "placeholder-and-image", "lone-vision-start", "audio-start-in-system"])
def test_special_tokens_in_message_text_are_plain_text(served, messages):
    r = _chat(served, messages)
    assert r.status_code == 200, r.text
    # the spelling took its characters' tokens (many), not one special token each
    plain = _chat(served, [{"role": m["role"], "content": "x"} for m in messages]).json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens"] > plain + 10


@pytest.mark.parametrize(("part", "what"), [
    ({"type": "image_url", "image_url": {"url": _data_url(image_bytes(size=(1000, 4)), "image/png")}}, "image"),
    ({"type": "video_url", "video_url": {"url": _data_url(video_bytes(size=(416, 2), n_frames=4), "video/mp4")}},
     "video"),
], ids=["image-1000x4", "video-416x2"])
def test_media_over_the_aspect_ratio_limit_is_a_media_error(served, part, what):
    r = _chat(served, [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["kind"] == "media" and error["type"] == "invalid_request_error"
    assert what in error["message"] and "aspect ratio" in error["message"]


def test_a_seven_one_soundtrack_is_answered_and_the_server_lives(served):
    """8 channels (an ordinary 7.1 WAV) once crashed the server process inside PyAV."""
    tone = 0.5 * np.sin(np.arange(8000) * 2 * np.pi * 300 / 16000)
    wav = base64.b64encode(many_channels_wav(8, tone)).decode()
    part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    r = _chat(served, [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}])
    assert r.status_code == 200, r.text
    assert _chat(served, [{"role": "user", "content": "hi"}]).status_code == 200


def test_the_aspect_ratio_is_refused_from_the_size_alone():
    """At planning, from the header's size: before a pixel is decoded. The encoders raise their own
    type (still a ValueError); the pipeline answers it as the client's media error."""
    with pytest.raises(AspectRatioError):
        smart_resize(4, 1000, 32, 1024, 1 << 20)
    assert issubclass(AspectRatioError, ValueError)
    pre = Preprocessor(ImageProcessingConfig())
    with pytest.raises(InvalidMediaError, match="1000x4 pixels"):
        pre.image_size(4, 1000)
    with pytest.raises(InvalidMediaError, match="2x416 pixels"):
        pre.video_size(416, 2, 4)
    assert pre.image_size(4, 600) == smart_resize(4, 600, 32, pre.image_config.min_pixels, pre.image_config.max_pixels)


def test_a_chat_of_200k_messages_is_refused_before_templating(served, monkeypatch):
    runtime = served.engine.runtime
    layout = runtime.model.layout

    def no_templating(*args, **kwargs):
        raise AssertionError("the chat was templated")

    monkeypatch.setattr(layout.tokenizer, "apply_chat_template", no_templating)
    chat = parse_messages([{"role": "user", "content": ""}] * 200_000)
    with pytest.raises(ContextLengthError, match="200000 messages"):
        asyncio.run(runtime.prepare_chat(chat))
    monkeypatch.undo()
    # through HTTP: the same 400 a too-long prompt gets
    r = _chat(served, [{"role": "user", "content": ""}] * 20_000)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["kind"]) == ("context_length_exceeded", "context_length")
    assert _chat(served, [{"role": "user", "content": "hi"}] * 10).status_code == 200  # a short chat still fits
