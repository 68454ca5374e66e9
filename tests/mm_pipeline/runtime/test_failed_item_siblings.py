"""One media item of a request fails: its siblings stop (runtime/chat_preparation.py ``_plan_all``).

``asyncio.gather`` left them running: the client had its 400 while the other items of its request
were still ingested and decoded on the media workers, holding them for nobody (the audit: a bad part
and 31 clips). Now the siblings are cancelled and awaited before the error goes out, and each
cancelled item leaves its planning pass, which stops its decode -- unless another request is
waiting for the same media, whose decode goes on for it."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from pathlib import Path

import pytest
from tests.support.media_samples import audio_bytes

from mm_pipeline.errors import UndecodableMediaError
from mm_pipeline.media.decode.budget import check
from mm_pipeline.prompt.messages import parse_messages
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

LIMIT_S = 20.0  # a hang, not a slow machine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def _chat(*clips: bytes):
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(c).decode(), "format": "wav"}}
             for c in clips]
    return parse_messages([{"role": "user", "content": [*parts, {"type": "text", "text": "Hi."}]}])


async def _until(condition, what: str, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_a_failed_item_stops_its_siblings_but_not_media_another_request_waits_for(ckpt) -> None:
    """Request A plans clip X; request B = [X, Y, Z, W] where W fails once Y and Z are decoding.
    B's error goes out after Y's and Z's decodes stopped (the pool holds only A's decode of X),
    and X, which A still waits for, is decoded once, for A."""
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048, decode_workers=4))
    x, y, z, w = (audio_bytes("wav", rate=16000, seconds=0.5 + 0.1 * k, channels=1) for k in range(4))
    rt = engine.runtime
    producer = rt.planner.producer
    audio_inputs = producer.audio_inputs
    gate = threading.Event()
    running: dict[bytes, object] = {}  # clip -> its decode's control, while decoding
    decoded: list[bytes] = []
    lock = threading.Lock()

    def held_decode(item, control, held, first=0):  # a long decode that checks its control, as frames do
        with lock:
            running[item.data] = control
        try:
            if item.data == w:  # fails once its siblings are decoding
                deadline = time.monotonic() + LIMIT_S
                while not (y in running and z in running) and time.monotonic() < deadline:
                    time.sleep(0.005)
                raise UndecodableMediaError("this clip does not decode")
            while not gate.wait(0.005):
                check(control)
            decoded.append(item.data)
            return audio_inputs(item, control, held, first)
        finally:
            with lock:
                running.pop(item.data, None)

    producer.audio_inputs = held_decode

    async def main() -> None:
        a = asyncio.create_task(rt.prepare_chat(_chat(x)))
        await _until(lambda: x in running, "A's decode of X did not start")
        with pytest.raises(UndecodableMediaError, match=r"content\[3\].*does not decode"):
            await asyncio.wait_for(rt.prepare_chat(_chat(x, y, z, w)), LIMIT_S)
        # not when the siblings' decodes end (they wait on the gate, never set yet): Y and Z stopped,
        # X goes on for A (10 s: a loaded host's thread wake-ups, far from the old code's "never")
        await _until(lambda: rt.pool.admitted == 1, f"{rt.pool.admitted} media calls still admitted", 10.0)
        assert list(running) == [x] and not running[x].cancelled  # type: ignore[attr-defined]
        gate.set()
        prepared = await asyncio.wait_for(a, LIMIT_S)
        assert len(prepared.plans) == 1 and prepared.plans[0].units
        await _until(lambda: rt.pool.admitted == 0, "media calls left admitted")

    try:
        asyncio.run(main())
        assert decoded == [x]  # once, for A; Y and Z were never decoded to the end
        rt.planner._planning.check_integrity()
        rt.pool.check_integrity()
    finally:
        gate.set()  # (the old code's orphaned decodes end too)
        engine.shutdown()
