"""vLLM's --limit-mm-per-prompt (our media_max_items_per_kind): most items of each kind in one
request, checked from the parts before anything is read and again on the kinds ingest sniffed (a
``file`` part names none); 0 refuses the kind with a message saying so and leaves its encoder
unloaded (a video's sound keeps the audio encoder while videos are allowed). Bad settings are usage
errors naming the flag."""

from __future__ import annotations

import asyncio
import base64

import pytest

from llm_core import SamplingParams
from mm_pipeline.errors import InvalidInputError
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from tests.support.media_samples import audio_bytes, image_bytes, video_bytes
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def test_the_setting_is_checked_and_kept_as_json() -> None:
    limits = MediaLimits(max_items_per_kind={"video": 1, "image": 0})
    assert limits.max_items_per_kind == '{"image": 0, "video": 1}' and limits.per_kind == {"image": 0, "video": 1}
    assert MediaLimits(max_items_per_kind='{"audio": 2}').per_kind == {"audio": 2}
    assert not limits.allows("image") and limits.allows("video") and limits.allows("audio")
    assert limits.check_counts({"video": 1, "audio": 9}) is None
    assert "2 video items, limit 1" in limits.check_counts({"video": 2})
    assert "image input is disabled" in limits.check_counts({"image": 1})
    for bad, match in [('{"gif": 1}', r"unknown kind\(s\) gif"), ('{"image": -1}', "integer >= 0"),
                       ('{"image": true}', "integer >= 0"), ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=match):
            MediaLimits(max_items_per_kind=bad)


def test_cli_spellings(capsys) -> None:
    from mm_pipeline import cli

    args = cli.build_parser().parse_args(["serve", "--model", "m", "--limit-mm-per-prompt", '{"image": 2}'])
    assert cli.engine_config(args).limits.per_kind == {"image": 2}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--model", "m", "--limit-mm-per-prompt", '{"img": 2}'])
    assert "unknown kind(s) img" in capsys.readouterr().err


def _chat(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is here?"}]}]


def _image(seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG", size=(48 + 8 * seed, 40))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


async def _run(engine: OmniEngine, messages: list[dict]) -> int:
    tokens = 0
    async for d in engine.generate(messages, ONE):
        tokens += len(d.new_token_ids)
    return tokens


def test_limits_per_kind_and_disabled_encoders() -> None:
    config = dict(num_full_tokens=4096, num_swa_tokens=2048)
    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(
        media_max_items_per_kind='{"image": 1, "audio": 0}', **config))
    try:
        model = engine.runtime.model
        assert model.vision is not None and model.audio is not None  # videos may carry sound
        assert asyncio.run(_run(engine, _chat(_image(0)))) == 1
        with pytest.raises(InvalidInputError, match="2 image items, limit 1"):
            asyncio.run(_run(engine, _chat(_image(0), _image(1))))
        wav = base64.b64encode(audio_bytes()).decode()
        with pytest.raises(InvalidInputError, match="audio input is disabled"):
            asyncio.run(_run(engine, _chat({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}})))
        # a file part names no kind: counted once ingest sniffed it (bytes inline as file_data)
        png = "data:;base64," + base64.b64encode(image_bytes("PNG", size=(56, 40))).decode()
        with pytest.raises(InvalidInputError, match="2 image items, limit 1"):
            asyncio.run(_run(engine, _chat(_image(0), {"type": "file", "file": {"file_data": png}})))
        # a disabled kind in a file part is refused once sniffed, before it is decoded or planned
        before = engine.stats().media
        wav_file = "data:;base64," + wav
        with pytest.raises(InvalidInputError, match="audio input is disabled"):
            asyncio.run(_run(engine, _chat({"type": "file", "file": {"file_data": wav_file}})))
        after = engine.stats().media
        assert after.get("audio_decoded", 0) == before.get("audio_decoded", 0)
        assert after.get("manifest_misses.audio", 0) == before.get("manifest_misses.audio", 0)
    finally:
        engine.shutdown()
    # no images and no videos: no vision tower; no audio and no videos: no audio encoder
    for limits, vision, audio in [('{"image": 0, "video": 0}', False, True), ('{"audio": 0, "video": 0}', True, False)]:
        engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(
            media_max_items_per_kind=limits, **config))
        try:
            assert (engine.runtime.model.vision is not None, engine.runtime.model.audio is not None) == (vision, audio)
            if not vision:
                clip = base64.b64encode(video_bytes(n_frames=4)).decode()
                with pytest.raises(InvalidInputError, match="video input is disabled"):
                    asyncio.run(_run(engine, _chat({"type": "video_url",
                                                    "video_url": {"url": "data:video/mp4;base64," + clip}})))
            assert asyncio.run(_run(engine, [{"role": "user", "content": "Hello"}])) == 1  # text still served
        finally:
            engine.shutdown()
