"""Warm paths of the omni runtime: a repeat's cached units are in its stream before the engine sees
the request (one prefill, no race with the engine thread); a repeated source known by the source
memo gives the cold tokens, served from the cache without its bytes, or decoded after all when the
cache lost its units."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
from tests.support.media_samples import video_bytes

from llm_core import SamplingParams
from mm_pipeline.media.source_memo import SourceMemo
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
VIDEO = video_bytes(n_frames=20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def make(ckpt, **kw) -> OmniEngine:
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048, **kw))


def ask(url: str, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def durl(data: bytes) -> str:
    return "data:;base64," + base64.b64encode(data).decode()


async def tokens(engine: OmniEngine, messages) -> list[int]:
    return [t async for d in engine.generate(messages, GREEDY) for t in d.new_token_ids]


def test_a_repeats_cached_units_are_in_its_stream_when_it_is_submitted(ckpt) -> None:
    engine = make(ckpt)
    seen: list[tuple[int, int]] = []
    submit = engine.runtime.submit

    def spy(rid, token_ids, params, stream, *rest) -> None:
        seen.append((stream.ready_until(), stream.prompt_len))
        submit(rid, token_ids, params, stream, *rest)

    engine.runtime.submit = spy
    try:
        cold = asyncio.run(tokens(engine, ask(durl(VIDEO))))
        again = asyncio.run(tokens(engine, ask(durl(VIDEO))))
        other = asyncio.run(tokens(engine, [{"role": "user", "content": [
            {"type": "text", "text": "First this."}, *ask(durl(VIDEO))[0]["content"]]}]))
    finally:
        engine.shutdown()
    assert again == cold and len(other) == len(cold)
    (ready, total), *repeats = seen
    assert ready < total  # cold: the video's units come while it runs
    assert all(ready == total for ready, total in repeats)  # every unit was a hit, delivered before


def test_a_remembered_file_gives_the_cold_tokens_with_or_without_its_cached_units(ckpt, tmp_path) -> None:
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(VIDEO)
    engine = make(ckpt, allowed_local_dirs=(str(tmp_path),))
    engine.runtime.ingestor.source_memo = SourceMemo(racy_s=0.0)  # the file is milliseconds old
    try:
        cold = asyncio.run(tokens(engine, ask(str(clip))))
        hit = asyncio.run(tokens(engine, ask(clip.as_uri())))
        media = engine.stats().media
        assert media["source_memo_hits.video"] == 1 and media["content_hashes.video"] == 1
        decoded = media["video_chunks_decoded"]
        memory = engine.runtime.cache.tiers[0]
        for key in memory.keys():  # the cache lost the manifest and every unit: decode after all
            memory.delete(key)
        lost = asyncio.run(tokens(engine, ask(str(clip))))
        media = engine.stats().media
        assert media["source_memo_hits.video"] == 2 and media["video_chunks_decoded"] > decoded
    finally:
        engine.shutdown()
    assert hit == cold and lost == cold
