"""The encoder cache's counters count each request's lookups once: a cold item then its repeat move
hits and misses by the item's units once each (the planning lookup; the producer's re-check before
decoding is not counted), and its manifest once (the one-hop read's miss is not counted, its
planning pass's read is). So OmniStats' hit rate and the stats line's are the requests' own."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import pytest
from tests.support.media_samples import image_bytes, video_bytes

from llm_core import SamplingParams
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from mm_pipeline.server.metrics import StatsLogger
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
VIDEO = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)  # 8 s -> 8 sampled frames -> 4 groups
IMAGE = image_bytes(size=(80, 60))  # one unit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def ask(kind: str, data: bytes) -> list[dict]:
    url = "data:;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": f"{kind}_url", f"{kind}_url": {"url": url}},
                                         {"type": "text", "text": "Describe."}]}]


async def header_hits(engine: OmniEngine, messages: list[dict]) -> int:
    """X-Encoder-Cache-Hits of one chat: the units its planning found in the cache."""
    deltas = [d async for d in engine.generate(messages, GREEDY)]
    return deltas[0].encoder_cache_hits


def settled(engine: OmniEngine, looked: int):
    """The published snapshot once it holds ``looked`` more unit lookups (it follows the engine's
    steps; the last one may be an idle wake-up behind)."""
    deadline = time.monotonic() + 5
    while True:
        s = engine.stats()
        if sum(s.encoder_cache_hits.values()) + s.encoder_cache_misses >= looked or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


def test_a_cold_item_then_its_repeat_count_each_unit_and_manifest_once(ckpt) -> None:
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
        max_num_batched_tokens=64, groups_per_chunk=1))
    try:
        before = engine.stats()
        headers = {(kind, turn): asyncio.run(header_hits(engine, ask(kind, data)))
                   for kind, data in (("image", IMAGE), ("video", VIDEO)) for turn in ("cold", "repeat")}
        assert headers == {("image", "cold"): 0, ("image", "repeat"): 1, ("video", "cold"): 0, ("video", "repeat"): 4}
        units = 2 * (1 + 4)  # each item asked twice
        after = settled(engine, units)
        assert after.encoder["encoded.image"] == 1 and after.encoder["encoded.video"] == 4
        hits = sum(after.encoder_cache_hits.values()) - sum(before.encoder_cache_hits.values())
        misses = after.encoder_cache_misses - before.encoder_cache_misses
        # the cold turns' units missed once (not again when produced), the repeats' hit: the headers' sum
        assert (hits, misses) == (1 + 4, 1 + 4) == (sum(headers.values()), units - sum(headers.values()))
        # a manifest once per request: as the planner's per-kind counts say
        cache, media = after.encoder_cache, after.media
        assert (cache["manifest_hits"], cache["manifest_misses"]) == (2, 2)
        assert cache["manifest_hits"] == media["manifest_hits.image"] + media["manifest_hits.video"]
        assert cache["manifest_misses"] == media["manifest_misses.image"] + media["manifest_misses.video"]
        assert media["unit_hits"] == 1 + 4 and media.get("unit_hits_at_claim", 0) == 0
        line = StatsLogger.line(before, after)
        assert line is not None and "encoder cache hits 50.0 % of 10 units" in line, line
    finally:
        engine.shutdown()
