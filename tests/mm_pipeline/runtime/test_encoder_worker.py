"""The encoder on its own worker thread beside the LLM steps (mm_pipeline/runtime/encoder_worker.py):
greedy tokens equal the serial path (encoder batches inline on the engine thread) for video, image and
audio requests running together, with one encoder lane and with two; the worker, not the engine
thread, ran the forwards; lanes run side by side, each unit once, a failing batch fails only its
units; the thread split; the config switches as CLI flags."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
from tests.support.media_samples import audio_bytes, image_bytes, video_bytes

from llm_core import SamplingParams
from mm_pipeline import cli
from mm_pipeline.runtime.encoder_worker import split_threads
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
VIDEO = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)  # 4 frame groups


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def part(kind: str, data: bytes) -> dict:
    return {"type": f"{kind}_url", f"{kind}_url": {"url": "data:;base64," + base64.b64encode(data).decode()}}


CHATS = [
    [{"role": "user", "content": [part("video", VIDEO), {"type": "text", "text": "What happens?"}]}],
    [{"role": "user", "content": [part("image", image_bytes(size=(80, 60))), {"type": "text", "text": "Describe."}]}],
    [{"role": "user", "content": [part("audio", audio_bytes(seconds=1.5)), {"type": "text", "text": "Transcribe."}]}],
]


def run_all(ckpt, **kw) -> tuple[list[list[int]], OmniEngine]:
    cfg = OmniEngineConfig.from_kwargs(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
                                       max_num_batched_tokens=64, groups_per_chunk=1, **kw)
    engine = OmniEngine.from_pretrained(ckpt, cfg)

    async def one(messages) -> list[int]:
        return [t async for d in engine.generate(messages, GREEDY) for t in d.new_token_ids]

    async def everything() -> list[list[int]]:
        return list(await asyncio.gather(*(one(m) for m in CHATS)))

    return asyncio.run(everything()), engine


def test_worker_tokens_equal_the_serial_path_and_the_worker_ran_the_encoder(ckpt, one_thread):
    serial, engine = run_all(ckpt, encoder_worker=False)
    try:
        assert engine.runtime.encoder_worker is None
        assert engine.runtime.loop.counts["encoder_units"] >= 6  # 4 groups + image + audio, inline
    finally:
        engine.shutdown()
    for lanes in (1, 2):
        overlapped, engine = run_all(ckpt, encoder_lanes=lanes)  # the worker is on by default
        try:
            worker = engine.runtime.encoder_worker
            assert worker is not None and worker.alive and worker.lanes == lanes
            assert worker.counts["encoder_units"] >= 6 and engine.runtime.loop.counts["encoder_units"] == 0
            assert engine.stats().engine_loop["encoder_units"] >= 6  # one family either way
            names = {t.name for t in threading.enumerate()}
            assert "omni-encoder" in names and ("omni-encoder-1" in names) == (lanes == 2)
        finally:
            engine.shutdown()
        assert not worker.alive  # shutdown stops the worker's threads
        assert overlapped == serial and all(len(t) == GREEDY.max_tokens for t in serial)


def test_lanes_encode_side_by_side_each_unit_once() -> None:
    """Two lanes: two forwards run at the same time (each waits at a barrier for the other), each
    lane at its share of the intra-op threads; every unit is encoded exactly once; a failing forward
    fails its own unit only, the lanes go on; stop ends both lanes."""
    import time

    import torch

    from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
    from mm_pipeline.encode.preprocess import VisionInput
    from mm_pipeline.runtime.encoder_worker import EncoderWorker, default_threads, lane_threads

    barrier = threading.Barrier(2, timeout=10)
    calls: list[tuple[str, int, int]] = []  # (lane thread, its intra-op threads, units)
    encoded: list[float] = []

    class Tower(torch.nn.Module):
        def encode_items(self, items):
            calls.append((threading.current_thread().name, torch.get_num_threads(), len(items)))
            if any(rows[0, 0] < 0 for rows, _ in items):
                raise RuntimeError("bad unit")
            if len(calls) <= 2:
                barrier.wait()  # the first two forwards overlap, or this times out
            encoded.extend(float(rows[0, 0]) for rows, _ in items)
            return [rows[:1].clone() for rows, _ in items]

    got: dict[str, object] = {}
    batcher = EncoderBatcher(Tower(), None, BatcherConfig(max_wait_s=0.0))
    worker = EncoderWorker(batcher, lanes=2)
    batcher.on_submit = worker.wake
    share = lane_threads(default_threads(), 2)

    def submit(k: int, value: float) -> None:
        batcher.attach(f"u{k}", lambda rows, err, k=k: got.__setitem__(f"u{k}", rows if err is None else err))
        batcher.submit(EncoderJob(f"u{k}", "video", vision=VisionInput(torch.full((4, 8), value), (1, 2, 2))))

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 15
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.002)

    worker.start()
    try:
        for k in range(2):  # a lane takes ceil(pending / 2): one each, the two forwards meet
            submit(k, float(k))
        wait_for(2)
        submit(2, -1.0)  # alone: a failing forward fails the units of its batch
        wait_for(3)
        for k in (3, 4):
            submit(k, float(k))
        wait_for(5)
    finally:
        worker.stop()
    assert not worker.alive
    assert {name for name, _, _ in calls[:2]} == {"omni-encoder", "omni-encoder-1"}
    assert all(threads == share for _, threads, _ in calls)
    assert sorted(encoded) == [0.0, 1.0, 3.0, 4.0]  # each good unit once
    assert isinstance(got["u2"], RuntimeError) and "bad unit" in str(got["u2"])
    assert all(float(got[f"u{k}"][0, 0]) == v for k, v in ((0, 0.0), (1, 1.0), (3, 3.0), (4, 4.0)))
    assert batcher.stats()["in_flight_units"] == 0 and worker.counts["encoder_units"] == 4
    batcher.check_integrity()
    # a non-CPU encoder keeps one lane (CUDA: its one stream); lanes < 1 is an error
    assert EncoderWorker(batcher, device="meta", lanes=2).lanes == 1
    with pytest.raises(ValueError, match="lanes"):
        EncoderWorker(batcher, lanes=0)


def test_thread_split() -> None:
    assert split_threads(2, 0) == (1, 1)
    assert split_threads(8, 0) == (4, 4) and split_threads(7, 0) == (4, 3)
    assert split_threads(8, 2) == (6, 2)
    assert split_threads(1, 0) == (1, 1) and split_threads(2, 4) == (1, 4)  # each keeps one at least
    with pytest.raises(ValueError, match="encoder_threads"):
        split_threads(2, -1)
    with pytest.raises(ValueError, match="encoder_threads"):
        OmniEngineConfig(encoder_threads=-1)


def test_worker_following_the_decoders_takes_the_cpus_they_leave() -> None:
    """``encoder_threads`` 0: before each batch the worker sets total - busy decode workers (at
    least 1) intra-op threads; the forwards run with exactly that many."""
    import time

    import torch

    from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
    from mm_pipeline.encode.preprocess import VisionInput
    from mm_pipeline.runtime.encoder_worker import EncoderWorker, free_cpu_threads

    seen: list[int] = []

    class Tower(torch.nn.Module):
        def encode_items(self, items):
            seen.append(torch.get_num_threads())
            return [torch.zeros(1, 4) for _ in items]

    busy = [3]
    batcher = EncoderBatcher(Tower(), None, BatcherConfig(max_wait_s=0.0))
    worker = EncoderWorker(batcher, threads=free_cpu_threads(4, lambda: busy[0]))
    batcher.on_submit = worker.wake
    worker.start()
    try:
        for k, b in enumerate((3, 3, 1, 0, 9)):
            busy[0] = b
            batcher.attach(f"u{k}", lambda rows, err: None)
            batcher.submit(EncoderJob(f"u{k}", "image", vision=VisionInput(torch.zeros(4, 8), (1, 2, 2))))
            deadline = time.monotonic() + 10
            while len(seen) <= k and time.monotonic() < deadline:
                time.sleep(0.002)
    finally:
        worker.stop()
    assert seen == [1, 1, 3, 4, 1] and worker.counts["thread_changes"] == 3
    with pytest.raises(ValueError, match="total"):
        free_cpu_threads(0, lambda: 0)


def test_a_second_lane_waits_for_a_cpu_the_decoders_leave() -> None:
    """``spare`` (the CPUs the busy decode workers leave) 1: only the first lane encodes, taking the
    whole queue; once it says 2 the second lane joins within its poll (nothing wakes it)."""
    import time

    import torch

    from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
    from mm_pipeline.encode.preprocess import VisionInput
    from mm_pipeline.runtime.encoder_worker import EncoderWorker

    spare = [1]
    gate = threading.Event()
    calls: list[tuple[str, int]] = []

    class Tower(torch.nn.Module):
        def encode_items(self, items):
            calls.append((threading.current_thread().name, len(items)))
            gate.wait(10)  # the first lane stays busy until the test lets it go
            return [rows[:1].clone() for rows, _ in items]

    got: dict[str, object] = {}
    batcher = EncoderBatcher(Tower(), None, BatcherConfig(max_wait_s=0.0))
    worker = EncoderWorker(batcher, lanes=2, spare=lambda: spare[0])
    batcher.on_submit = worker.wake

    def submit(k: int) -> None:
        batcher.attach(f"u{k}", lambda rows, err, k=k: got.__setitem__(f"u{k}", err or rows))
        batcher.submit(EncoderJob(f"u{k}", "video", vision=VisionInput(torch.full((4, 8), float(k)), (1, 2, 2))))

    def wait_until(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.002)

    worker.start()
    try:
        submit(0)
        wait_until(lambda: len(calls) == 1)  # the first lane is busy with u0
        submit(1)
        submit(2)
        time.sleep(0.05)  # the second lane had many polls to take them, and may not
        assert len(calls) == 1 and batcher.stats()["pending"] == 2
        spare[0] = 2  # the decoders finished
        wait_until(lambda: len(calls) == 2)
        assert calls[1] == ("omni-encoder-1", 1)  # its share: half the queue
        gate.set()
        wait_until(lambda: len(got) == 3)
    finally:
        gate.set()
        worker.stop()
    assert sorted(got) == ["u0", "u1", "u2"] and worker.counts["encoder_units"] == 3
    batcher.check_integrity()


def test_worker_switch_and_threads_are_flags() -> None:
    assert OmniEngineConfig().encoder_worker is True
    cfg = cli.engine_config(cli.parse_args(["serve", "--model", "m", "--no-encoder-worker", "--encoder-threads", "1"]))
    assert cfg.encoder_worker is False and cfg.encoder_threads == 1
    cfg = cli.engine_config(cli.parse_args(["serve", "--model", "m", "--encoder-threads", "none"]))
    assert cfg.encoder_threads is None
    assert OmniEngineConfig().encoder_lanes == 2
    cfg = cli.engine_config(cli.parse_args(["serve", "--model", "m", "--encoder-lanes", "1"]))
    assert cfg.encoder_lanes == 1
    with pytest.raises(ValueError, match="encoder_lanes"):
        OmniEngineConfig(encoder_lanes=0)


def test_stage_timeline_summary() -> None:
    from mm_pipeline.runtime.timeline import StageTimeline

    tl = StageTimeline(max_spans=16)
    for stage, a, b in (("decode", 0.0, 1.0), ("decode", 0.5, 2.0), ("encode", 1.5, 2.5), ("prefill", 2.2, 3.0),
                        ("prefill", 9.0, 9.5)):
        tl.add(stage, 10 + a, 10 + b)
    s = tl.summary(10.0, 13.0)  # the last prefill span lies outside the window
    assert s["decode_busy"] == pytest.approx(2.0) and s["decode_first"] == 0.0 and s["decode_last"] == 2.0
    assert s["encode_busy"] == pytest.approx(1.0) and s["prefill_busy"] == pytest.approx(0.8)
    assert s["decode_encode_overlap"] == pytest.approx(0.5) and s["encode_prefill_overlap"] == pytest.approx(0.3)
    assert s["decode_prefill_overlap"] == 0.0
    assert (s["decode_spans"], s["encode_spans"], s["prefill_spans"]) == (2, 1, 1)
    with pytest.raises(ValueError, match="stage"):
        tl.add("upload", 0.0, 1.0)


def test_runtime_records_a_video_requests_stages(ckpt, one_thread) -> None:
    cfg = OmniEngineConfig.from_kwargs(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
                                       max_num_batched_tokens=64, groups_per_chunk=1)
    engine = OmniEngine.from_pretrained(ckpt, cfg)
    try:
        timeline = engine.runtime.record_timeline()
        asyncio.run(_drain(engine, CHATS[0]))
        stages = [s.stage for s in timeline.spans()]
        assert stages.count("decode") == 4 and stages.count("encode") >= 1 and stages.count("prefill") >= 1
    finally:
        engine.shutdown()


async def _drain(engine: OmniEngine, messages) -> None:
    async for _ in engine.generate(messages, GREEDY):
        pass


def test_start_up_objects_are_out_of_the_collectors_reach(ckpt) -> None:
    """A full collection would walk the model's and libraries' objects with every thread stopped (the
    event-loop stalls under media load): the runtime freezes what is alive when it starts."""
    import gc

    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(page_size=4, num_full_tokens=1024,
                                                                            num_swa_tokens=512))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, the tokenizer, the model's modules...
        assert len(gc.get_objects(generation=2)) < frozen // 4  # what a full collection still walks
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0  # a stopped runtime's objects can be collected again
