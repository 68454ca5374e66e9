"""The one-hop prepare of a chat with one media item (OmniRuntime.prepare_chat, MediaPlanner.plan_warm):
ingest, plan from the cached manifest and lay out in one worker job. It must give exactly what the
usual path (load, plan, render: three hops) gives, decline when the manifest is missing, malformed
or another request is planning the same media, and say which item failed as the usual path does."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import torch
from tests.support.media_samples import video_bytes

from llm_core import SamplingParams
from mm_pipeline.encode.cached_layout import _manifest_key
from mm_pipeline.errors import InvalidMediaError
from mm_pipeline.prompt.messages import parse_messages
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
VIDEO = video_bytes(n_frames=20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


@pytest.fixture
def engine(ckpt):
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048))
    yield engine
    engine.shutdown()


def ask(text: str = "Describe.", data: bytes = VIDEO) -> list[dict]:
    url = "data:;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


async def tokens(engine: OmniEngine, messages) -> list[int]:
    return [t async for d in engine.generate(messages, GREEDY) for t in d.new_token_ids]


def counts(engine: OmniEngine) -> dict[str, int]:
    return engine.runtime.planner.counts  # live (stats() is the engine thread's last snapshot)


def prepare(engine: OmniEngine, messages, *, one_hop: bool = True):
    rt = engine.runtime
    if not one_hop:  # the usual path: plan_warm declines every item
        rt.planner.plan_warm = lambda ref, salt=None, **_: (None, None)
    try:
        return asyncio.run(rt.prepare_chat(parse_messages(messages)))
    finally:
        rt.planner.__dict__.pop("plan_warm", None)


def layout(prepared) -> tuple:
    return (prepared.token_ids, prepared.spans, prepared.spans_of_plan, prepared.checkpoints,
            [(p.media_key, p.units, p.timestamps, p.decoded_bytes, sorted(p.cached)) for p in prepared.plans])


def test_one_hop_lays_out_exactly_what_the_usual_path_does(engine) -> None:
    cold = asyncio.run(tokens(engine, ask("Describe the video in detail.")))
    assert counts(engine).get("plans_one_hop.video", 0) == 0  # cold: declined (no manifest yet)
    assert counts(engine)["manifest_misses.video"] == 1  # the declined look is not counted as a miss
    usual = prepare(engine, ask("Describe the video, briefly."), one_hop=False)
    hop = prepare(engine, ask("Describe the video, briefly."))
    assert counts(engine)["plans_one_hop.video"] == 1
    assert layout(hop) == layout(usual)
    assert all(torch.equal(hop.plans[0].cached[i], usual.plans[0].cached[i]) for i in usual.plans[0].cached)
    assert sorted(hop.plans[0].cached) == list(range(len(hop.plans[0].units)))  # every unit a hit
    # served through the one hop, the same question gives the cold tokens
    assert asyncio.run(tokens(engine, ask("Describe the video in detail."))) == cold
    assert counts(engine)["plans_one_hop.video"] == 2


def test_a_malformed_manifest_is_not_used_and_is_written_again(engine) -> None:
    cold = asyncio.run(tokens(engine, ask()))
    rt = engine.runtime
    (mkey,) = {p.media_key for p in prepare(engine, ask()).plans}
    rt.cache.put(_manifest_key(mkey), torch.zeros(3))  # poisoned: not the manifest's [units, 4]
    hops, misses = counts(engine)["plans_one_hop.video"], counts(engine)["manifest_misses.video"]
    assert asyncio.run(tokens(engine, ask())) == cold
    assert counts(engine)["plans_one_hop.video"] == hops  # declined
    assert counts(engine)["manifest_misses.video"] == misses + 1  # planned from the media again
    assert rt.cache.get(_manifest_key(mkey)).shape[1] == 4  # ... which wrote a good manifest back
    assert asyncio.run(tokens(engine, ask())) == cold
    assert counts(engine)["plans_one_hop.video"] == hops + 1


def test_a_manifest_whose_units_were_evicted_plans_in_one_hop_and_encodes_again(engine) -> None:
    cold = asyncio.run(tokens(engine, ask()))
    rt = engine.runtime
    plan = prepare(engine, ask()).plans[0]
    memory = rt.cache.tiers[0]
    for unit in plan.units:  # the units went, the manifest stayed
        memory.delete(rt.cache.namespace + unit.key)
    hops, decoded = counts(engine)["plans_one_hop.video"], counts(engine)["video_chunks_decoded"]
    assert asyncio.run(tokens(engine, ask())) == cold
    assert counts(engine)["plans_one_hop.video"] == hops + 1
    assert counts(engine)["video_chunks_decoded"] > decoded  # produced again, not taken from a stale plan


def test_a_planning_pass_in_flight_is_joined_not_bypassed(engine) -> None:
    asyncio.run(tokens(engine, ask()))
    rt = engine.runtime
    ref = parse_messages(ask()).media[0]
    item, plan = rt.planner.plan_warm(ref)
    assert plan is not None
    waiter = lambda value, error: None  # noqa: E731
    assert rt.planner._planning.join(plan.media_key, waiter)  # another request is planning it now
    try:
        item, declined = rt.planner.plan_warm(ref)
    finally:
        rt.planner._planning.finish(plan.media_key, None)
    assert item is not None and item.content_key == plan.item.content_key and declined is None


def test_one_hop_errors_name_the_item_like_the_usual_path(engine) -> None:
    bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:;base64,@@@"}},
                                        {"type": "text", "text": "Describe."}]}]
    with pytest.raises(InvalidMediaError, match=r"messages\[0\]\.content\[0\]: data URL payload is not valid base64"):
        prepare(engine, bad)
    # http(s) and file ids are not ingested in the hop: plan_warm leaves them to load()
    web = parse_messages([{"role": "user", "content": [{"type": "video_url",
                                                        "video_url": {"url": "https://example.com/v.mp4"}}]}])
    assert engine.runtime.planner.plan_warm(web.media[0]) == (None, None)
