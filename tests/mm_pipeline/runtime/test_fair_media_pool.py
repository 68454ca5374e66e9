"""A request's media work never waits behind another request's video. The decode pool
(media/worker_pool.py: each request is a flow; a spare thread serves flows with nothing running):
with one decode worker held by a video's chunk decode, an image request is still answered; then the
video is, with the tokens it has when asked again. The encoder queue (encode/batcher.py, ``fair``):
an image sent while a video's frame groups queue is encoded next, in a batch of its own."""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path

import pytest
from tests.support.media_samples import image_bytes, video_bytes

from llm_core import SamplingParams
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LIMIT_S = 60.0  # a hang, not a slow machine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def ask(kind: str, data: bytes, text: str) -> list[dict]:
    url = "data:;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": f"{kind}_url", f"{kind}_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


async def tokens(engine: OmniEngine, messages) -> list[int]:
    return [t async for d in engine.generate(messages, GREEDY) for t in d.new_token_ids]


@pytest.mark.parametrize("spare", [1, 0])
def test_an_image_is_answered_while_a_video_holds_the_only_decode_worker(ckpt, spare: int) -> None:
    """With the spare thread (the default) the image is answered while the video's decode holds the
    worker; with ``--decode-spare-workers 0`` it waits for that decode (its turn comes next)."""
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048, decode_workers=1, decode_spare_workers=spare))
    video, image = ask("video", video_bytes(n_frames=22), "Describe."), ask("image", image_bytes(), "What?")
    gate = threading.Event()
    try:
        asyncio.run(tokens(engine, ask("video", video_bytes(n_frames=20), "Describe.")))  # warm paths
        producer = engine.runtime.planner.producer
        chunk = producer._video_chunk
        entered = threading.Event()

        def held_chunk(*args, **kwargs):  # the video's decode holds the worker until the image is answered
            entered.set()
            gate.wait(LIMIT_S)
            return chunk(*args, **kwargs)

        producer._video_chunk = held_chunk

        async def main() -> tuple[list[int], list[int]]:
            busy = asyncio.create_task(tokens(engine, video))  # a new video: its chunks are decoded
            while not entered.is_set():
                assert not busy.done(), busy
                await asyncio.sleep(0.005)
            assert engine.runtime.pool.busy == 1  # the one worker, held by the video
            if spare:
                answered = await asyncio.wait_for(tokens(engine, image), LIMIT_S)
                assert not busy.done()  # the image did not wait for it
                gate.set()
            else:
                waiting = asyncio.create_task(tokens(engine, image))
                await asyncio.sleep(0.5)
                assert not waiting.done()  # no thread for it while the video's decode runs
                gate.set()
                answered = await asyncio.wait_for(waiting, LIMIT_S)
            return answered, await asyncio.wait_for(busy, LIMIT_S)

        answered, contended = asyncio.run(main())
        assert len(answered) == GREEDY.max_tokens
        producer._video_chunk = chunk
        assert asyncio.run(tokens(engine, video)) == contended  # waiting changed none of its tokens
        engine.runtime.pool.check_integrity()
    finally:
        gate.set()
        engine.shutdown()


def test_an_image_is_encoded_apart_from_a_video_already_encoding(ckpt) -> None:
    """The encoder queue's turns (encode/batcher.py, ``fair``): a request's jobs carry its id; with the
    encoder held inside one of a video's batches while more of its frame groups queue, an image sent
    then is encoded next, in a batch of its own (this encoder runs on the CPU); both answers have the
    tokens they have alone."""
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(  # two frame groups per batch at most
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048, encoder_lanes=1, encoder_vision_budget=32))
    video, image = ask("video", video_bytes(n_frames=120), "Describe."), ask("image", image_bytes(), "What?")
    gate, held = threading.Event(), threading.Event()
    try:
        alone = asyncio.run(tokens(engine, image)), asyncio.run(tokens(engine, video))
        batcher = engine.runtime.batcher
        flows: dict[str, object] = {}
        submit, take = batcher.submit, batcher._take
        batches: list[list[str]] = []

        def recorded_submit(job):
            flows[job.key] = (job.flow, job.kind)
            submit(job)

        def held_take(encoder, force, lanes=1):  # the video's second batch waits at the gate
            batch = take(encoder, force, lanes)
            if batch:
                batches.append([flows[j.key][1] for j in batch])
                if len(batches) == 2:
                    held.set()
                    gate.wait(LIMIT_S)
            return batch

        batcher.submit, batcher._take = recorded_submit, held_take

        async def main() -> tuple[list[int], list[int]]:
            salted = engine.generate(video, GREEDY, request_id="the-video", cache_salt="apart")
            busy = asyncio.create_task(_collect(salted))
            while not held.is_set():
                assert not busy.done(), busy
                await asyncio.sleep(0.005)
            waiting = asyncio.create_task(_collect(engine.generate(image, GREEDY, request_id="the-image",
                                                                   cache_salt="apart")))
            while "image" not in {kind for _, kind in flows.values()}:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # more of the video's groups queue meanwhile
            gate.set()
            return await asyncio.wait_for(waiting, LIMIT_S), await asyncio.wait_for(busy, LIMIT_S)

        answered = asyncio.run(main())
        assert answered == alone  # the order of the batches changed no token
        assert {flow for flow, kind in flows.values() if kind == "image"} == {"the-image"}
        assert {flow for flow, kind in flows.values() if kind == "video"} == {"the-video"}
        assert batches[2] == ["image"], batches  # right after the held batch, alone
        assert any(len(b) > 1 for b in batches[3:]), batches  # the video's queued groups still batch together
        batcher.check_integrity()
    finally:
        gate.set()
        engine.shutdown()


async def _collect(outputs) -> list[int]:
    return [t async for d in outputs for t in d.new_token_ids]
