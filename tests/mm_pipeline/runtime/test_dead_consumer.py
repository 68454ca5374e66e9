"""A request whose consumer is gone costs that request alone.

The consumer of ``engine.generate`` can vanish without closing the generator (its event loop is
closed, e.g. a thread that ran ``loop.run_until_complete(agen.__anext__())`` and ended). Its sinks
then raise ("Event loop is closed") on the thread that delivers to them. Before, that exception
broke the delivery loop it was called from: the engine step's later outputs, the other waiters of a
shared encoder unit, and the other units of an encoder batch were never delivered, and the unit
keys of that batch stayed claimed, so every later request for that media hung too.
"""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from llm_core import SamplingParams
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
from tests.support.media_samples import image_bytes

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def _engine(ckpt, **kw) -> OmniEngine:
    cfg = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
               max_num_batched_tokens=64, groups_per_chunk=1)
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(**{**cfg, **kw}))


def _ask(data: bytes, part: str = "image_url") -> list[dict]:
    url = "data:;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": part, part: {"url": url}}, {"type": "text", "text": "Describe."}]}]


async def _tokens(engine: OmniEngine, messages: list[dict]) -> int:
    return sum([len(d.new_token_ids) async for d in engine.generate(messages, GREEDY)])


def _served(engine: OmniEngine, messages: list[dict], timeout_s: float = 20.0) -> int:
    """Tokens of one request run to its end on a fresh loop (TimeoutError: it hung)."""
    return asyncio.run(asyncio.wait_for(_tokens(engine, messages), timeout_s))


def _abandon_when(agen_first, ready) -> None:
    """Start a request on its own loop, run that loop until ``ready()``, then close it (the
    generator is never closed: its consumer just went away)."""
    loop = asyncio.new_event_loop()
    loop.create_task(agen_first)
    deadline = time.monotonic() + 15
    while not ready():
        loop.run_until_complete(asyncio.sleep(0.01))
        assert time.monotonic() < deadline, "the abandoned request never got that far"
    loop.close()


def test_an_engine_step_still_delivers_to_other_requests(ckpt):
    engine = _engine(ckpt)
    try:
        agen = engine.generate_prompt(list(range(5, 25)), SamplingParams(max_tokens=400, temperature=0.0,
                                                                          ignore_eos=True))
        loop = asyncio.new_event_loop()
        loop.run_until_complete(agen.__anext__())  # A generates; its consumer is gone from here on
        loop.close()

        async def b() -> int:
            return sum([len(d.new_token_ids) async for d in engine.generate_prompt(
                list(range(7, 27)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))])
        assert asyncio.run(asyncio.wait_for(b(), 20)) == 30
        loop_counts = engine.runtime.loop.counts
        assert loop_counts["sink_errors"] >= 1 and loop_counts["loop_errors"] == 0
        deadline = time.monotonic() + 5  # A was aborted: it does not generate its 400 tokens for nobody
        while engine.runtime.loop.num_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.runtime.loop.num_requests == 0
    finally:
        engine.shutdown()


def test_a_joiner_of_a_shared_unit_still_gets_its_rows(ckpt):
    engine = _engine(ckpt, stream_embeddings=False)  # the waiting request's progress callback is a loop call
    vision = engine.runtime.batcher.vision
    real, started = vision.encode_items, []

    def slow(items):
        started.append(1)
        time.sleep(1.0)  # B joins A's unit meanwhile
        return real(items)
    vision.encode_items = slow
    img = image_bytes(size=(64, 64))
    try:
        _abandon_when(engine.generate(_ask(img), GREEDY).__anext__(), lambda: bool(started))
        assert _served(engine, _ask(img)) == 4
        assert engine.runtime.batcher.stats()["in_flight_units"] == 0
    finally:
        engine.shutdown()


def test_batch_mates_are_delivered_and_their_keys_released(ckpt):
    engine = _engine(ckpt, stream_embeddings=False, encoder_max_wait_ms=3000, encoder_lanes=1)
    batcher = engine.runtime.batcher
    try:  # A's unit waits 3 s for company; C's joins its batch, then A's consumer goes
        _abandon_when(engine.generate(_ask(image_bytes(size=(64, 64))), GREEDY).__anext__(),
                      lambda: batcher.stats()["pending"] > 0)
        other = image_bytes(size=(48, 80))
        assert _served(engine, _ask(other)) == 4  # C, encoded in one forward with A's unit
        assert _served(engine, _ask(other)) == 4  # D: the key was released, not left claimed
        assert batcher.stats()["in_flight_units"] == 0
    finally:
        engine.shutdown()


def test_a_client_leaving_during_planning_does_not_fail_the_other(ckpt, monkeypatch):
    """Two requests for one cold video share one planning pass. The one that started it is
    cancelled (its client hung up) while it runs: before, the other got a 400 "planning was
    cancelled" for a valid video; the pass now goes on while any request still wants it."""
    from mm_pipeline.encode.planner import MediaPlanner
    from tests.support.media_samples import video_bytes

    real = MediaPlanner._plan_sync

    def slow_plan(self, *args, **kwargs):  # a slow probe: the window in which the first client leaves
        time.sleep(0.3)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(MediaPlanner, "_plan_sync", slow_plan)
    engine = _engine(ckpt)
    messages = _ask(video_bytes(n_frames=40, fps=10, size=(64, 48), gop=10), "video_url")

    async def main():
        first = asyncio.create_task(_tokens(engine, messages))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(_tokens(engine, messages))
        await asyncio.sleep(0.05)
        first.cancel()
        return await asyncio.gather(first, second, return_exceptions=True)
    try:
        first, second = asyncio.run(asyncio.wait_for(main(), 30))
        assert isinstance(first, asyncio.CancelledError) and second == 4
        assert engine.runtime.planner.counts["plan_joins"] == 1
    finally:
        engine.shutdown()


def test_a_request_joining_a_decode_that_is_being_dropped_gets_its_units(ckpt, monkeypatch):
    """A's client leaves while its video decodes; the decode worker sees that nobody wants the
    units and stops. B asks for the same video right then, before the producer has failed the
    units, so B joins their claims: before, B failed with "decoding ... was cancelled (no request
    wants it)"; the units B wants are now produced again."""
    import threading

    import mm_pipeline.media.decode.backend as backend_module
    from mm_pipeline.media.decode.budget import DecodeCancelled
    from tests.support.media_samples import video_bytes

    real, stopping, first = backend_module.decode_chunk, threading.Event(), [True]

    def decode_chunk(item, info, indices, groups, tp, limits, size=None, control=None, **opts):
        if first[0]:  # the first chunk decodes until nobody wants it, and unwinds slowly
            first[0] = False
            try:
                for _ in range(300):
                    control.check()
                    time.sleep(0.01)
            except DecodeCancelled:
                stopping.set()
                time.sleep(0.3)
                raise
        return real(item, info, indices, groups, tp, limits, size, control, **opts)
    monkeypatch.setattr(backend_module, "decode_chunk", decode_chunk)
    engine = _engine(ckpt)
    messages = _ask(video_bytes(n_frames=20, fps=10, size=(64, 48), gop=10), "video_url")

    async def main():
        a = asyncio.create_task(_tokens(engine, messages))
        await asyncio.sleep(0.3)
        a.cancel()
        while not stopping.is_set():
            await asyncio.sleep(0.001)
        b = asyncio.create_task(_tokens(engine, messages))
        return await asyncio.gather(a, b, return_exceptions=True)
    try:
        a, b = asyncio.run(asyncio.wait_for(main(), 30))
        assert isinstance(a, asyncio.CancelledError) and b == 4
        assert engine.runtime.planner.counts["productions_restarted"] == 1
    finally:
        engine.shutdown()
