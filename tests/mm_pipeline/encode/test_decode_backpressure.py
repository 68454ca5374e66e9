"""Decoded rows stay in the decode budget until the encoder is done with them: a production moves
the bytes of its patch rows out of the decode's reservation into a hold its encoder job carries,
and the batcher releases each job's hold exactly once -- after the forward, on an encoder error,
after the one-by-one retry of a failing or non-finite pack, when ``submit`` refuses the job -- and
the production releases what no job took (a failure, a cancelled request). So while the encoder is
slower than the decoders, decodes wait for it instead of queueing rows beyond
``max_decoded_bytes_in_flight``, and a long video under a small budget still finishes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from encoders.image_processing import ImageProcessingConfig
from encoders.vision.tower import VisionTransformer
from llm_core.storage import MemoryStore
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.encode.planner import MediaPlanner
from mm_pipeline.encode.preprocess import Preprocessor, VisionInput
from mm_pipeline.errors import UndecodableMediaError
from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import DecodedImage, MediaSource
from mm_pipeline.media.worker_pool import WorkerPool
from samples.checkpoints.tiny_towers import init_random_, tiny_vision_config
from tests.support.media_samples import video_bytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def vision():
    return init_random_(VisionTransformer(tiny_vision_config()), 0).eval()


@pytest.fixture()
def pool():
    pool = WorkerPool(2, 16)
    yield pool
    pool.shutdown()


# ---- the budget's hand-on ----------------------------------------------------------------------
def test_hand_on_keeps_bytes_counted_past_the_block_and_releases_once():
    budget = DecodeBudget(100)
    with budget.reserve(60) as reservation:
        hold = reservation.hand_on(25)
        assert reservation.hand_on(1000).nbytes == 35  # at most what the block still holds
        assert budget.in_use == 60
    assert budget.in_use == 60  # both holds outlive the block
    hold.release()
    hold.release()  # a second release gives back nothing more
    assert budget.in_use == 35
    with pytest.raises(RuntimeError):
        reservation.hand_on(1)  # the block ended: nothing left to move
    budget.check_integrity()


def test_hold_parts_release_the_bytes_with_the_last_holder():
    budget = DecodeBudget(100)
    with budget.reserve(40) as reservation:
        parts = reservation.hand_on(40).parts(3)
    parts[0]()
    parts[0]()  # counts once
    parts[1]()
    assert budget.in_use == 40
    parts[2]()
    assert budget.in_use == 0


# ---- the batcher releases every job once, on every path -------------------------------------------
class Releases:
    def __init__(self):
        self.calls: dict[str, int] = {}

    def job(self, key: str, kind: str = "image", **inp) -> EncoderJob:
        def release() -> None:
            self.calls[key] = self.calls.get(key, 0) + 1
        return EncoderJob(key, kind, release=release, **inp)


def _vision_input(seed: int, h: int = 64, w: int = 64) -> VisionInput:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    pre = Preprocessor(ImageProcessingConfig(min_pixels=32 * 32, max_pixels=128 * 128))
    return pre.image(DecodedImage(pixels, "png"))


def test_batcher_releases_each_job_once_after_its_forward(vision):
    rel = Releases()
    b = EncoderBatcher(vision, None, BatcherConfig(max_wait_s=10.0))
    for k in range(3):
        assert b.attach(f"u{k}", lambda rows, err: None)
        b.submit(rel.job(f"u{k}", vision=_vision_input(k)))
    assert rel.calls == {}  # queued: still counted
    assert b.run_due(force=True) == 3
    assert rel.calls == {"u0": 1, "u1": 1, "u2": 1}


def test_batcher_releases_once_when_a_pack_fails_and_is_encoded_one_by_one(vision):
    class Flaky(torch.nn.Module):
        """Fails every packed forward and the unit "bad" alone; NaN rows for "nan" alone."""

        def encode_items(self, items):
            if len(items) > 1:
                raise RuntimeError("packed forward failed")
            rows = vision.encode_items(items)
            if float(items[0][0][0, 0]) == seen["bad"]:
                raise RuntimeError("this unit breaks the encoder")
            return [r.fill_(float("nan")) for r in rows] if float(items[0][0][0, 0]) == seen["nan"] else rows

    inputs = {k: _vision_input(s) for s, k in enumerate(["ok", "bad", "nan"])}
    seen = {k: float(v.rows[0, 0]) for k, v in inputs.items()}
    assert len(set(seen.values())) == 3
    rel, got = Releases(), {}
    b = EncoderBatcher(Flaky(), None, BatcherConfig(max_wait_s=10.0))
    for k, v in inputs.items():
        assert b.attach(k, lambda rows, err, k=k: got.__setitem__(k, err if err is not None else rows))
        b.submit(rel.job(k, vision=v))
    b.run_due(force=True)
    assert isinstance(got["ok"], torch.Tensor)
    assert isinstance(got["bad"], RuntimeError) and isinstance(got["nan"], RuntimeError)
    assert rel.calls == {"ok": 1, "bad": 1, "nan": 1}


def test_batcher_releases_once_when_the_packed_rows_are_not_finite(vision):
    class NanInPack(torch.nn.Module):
        """A packed forward gives "n" NaN rows; alone every unit is fine (the retry path)."""

        def encode_items(self, items):
            rows = vision.encode_items(items)
            if len(items) > 1:
                rows[1] = rows[1].clone().fill_(float("nan"))
            return rows

    rel, got = Releases(), {}
    b = EncoderBatcher(NanInPack(), None, BatcherConfig(max_wait_s=10.0))
    for s, k in enumerate(["a", "n"]):
        assert b.attach(k, lambda rows, err, k=k: got.__setitem__(k, err if err is not None else rows))
        b.submit(rel.job(k, vision=_vision_input(s)))
    assert b.run_due(force=True) == 2
    assert all(isinstance(r, torch.Tensor) for r in got.values())
    assert rel.calls == {"a": 1, "n": 1}


def test_batcher_releases_a_job_it_refuses(vision):
    rel = Releases()
    b = EncoderBatcher(vision, None)
    assert b.attach("a", lambda rows, err: None)
    b.submit(rel.job("a", "audio", mel=torch.zeros(4, 8)))  # no audio encoder: failed at once
    with pytest.raises(ValueError, match="without being claimed"):
        b.submit(rel.job("x", vision=_vision_input(0)))
    assert rel.calls == {"a": 1, "x": 1}


def test_batcher_releases_when_a_sink_raises(vision):
    rel = Releases()
    b = EncoderBatcher(vision, None, BatcherConfig(max_wait_s=10.0))

    def sink(rows, err):
        raise RuntimeError("the consumer is gone")

    assert b.attach("s", sink)
    b.submit(rel.job("s", vision=_vision_input(0)))
    try:
        b.run_due(force=True)
    except RuntimeError:
        pass  # however the delivery ended, the job is done with
    assert rel.calls == {"s": 1}


# ---- production: rows wait inside the budget -------------------------------------------------------
def _planner(vision, pool, budget: int, max_frames: int = 64) -> MediaPlanner:
    limits = MediaLimits(max_decoded_bytes_in_flight=budget, decode_timeout_s=120.0)
    # max_wait_s 0: a batch is due as soon as something waits (the test decides when it runs)
    batcher = EncoderBatcher(vision, None, BatcherConfig(max_wait_s=0.0))
    return MediaPlanner(Preprocessor(ImageProcessingConfig()), EncoderCache([MemoryStore(1 << 24)]), batcher, pool,
                        MediaIngestor(IngestConfig(limits=limits), pool), "tiny",
                        PlannerConfig(limits=limits, video_sampling=VideoSamplingParams(fps=10.0, min_frames=2,
                                                                                         max_frames=max_frames)))


def _pending_bytes(batcher: EncoderBatcher) -> int:
    with batcher._lock:
        return sum(j.vision.rows.untyped_storage().nbytes() for j in batcher._pending["vision"])


class Sinks:
    def __init__(self, n: int):
        self.rows: dict[int, torch.Tensor] = {}
        self.errors: dict[int, BaseException] = {}
        self.sinks = [self._sink(i) for i in range(n)]

    def _sink(self, i: int):
        def deliver(rows, error):
            if error is not None:
                self.errors[i] = error
            else:
                self.rows[i] = rows
        return deliver

    @property
    def done(self) -> int:
        return len(self.rows) + len(self.errors)


async def _start_video(planner: MediaPlanner) -> tuple:
    """A 64-frame 320x240 video planned and started with nobody encoding; returns when its decode
    settled (the budget full, or every group queued): (plan, sinks)."""
    data = video_bytes(n_frames=64, size=(320, 240), fps=10)
    plan = await planner.plan(await planner.ingestor.ingest(MediaSource(data=data)))
    sinks = Sinks(len(plan.units))
    planner.start(plan, sinks.sinks)
    await _settle(planner.batcher)
    return plan, sinks


async def _settle(batcher: EncoderBatcher, timeout_s: float = 20.0) -> None:
    """Until the queue stops growing (production waits for the budget) or every unit is queued."""
    last, since, end = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        n = batcher.stats()["pending"]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > 0.5:
            return
        await asyncio.sleep(0.02)


async def _drain(planner: MediaPlanner, sinks: Sinks, n: int, timeout_s: float = 60.0) -> int:
    """The encoder catches up: run the due batches until every unit is delivered; the most bytes
    of rows the queue held meanwhile."""
    most, end = 0, time.monotonic() + timeout_s
    while sinks.done < n and time.monotonic() < end:
        most = max(most, _pending_bytes(planner.batcher))
        planner.batcher.run_due(force=True)
        await asyncio.sleep(0.005)
    while planner.producer._tasks and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return most


def test_rows_waiting_for_the_encoder_stay_in_the_decode_budget(vision, pool):
    """/tmp/review_enc/pending_rows_outside_budget.py in small: a 64-frame 320x240 video's 32 groups
    of rows (~1.8 MiB each) under an 8 MiB budget while nobody encodes. Before, the budget was
    released as each chunk was patchified and all 60 MiB of rows waited in the queue."""
    budget = 8 * MIB
    planner = _planner(vision, pool, budget)

    async def run():
        plan, sinks = await _start_video(planner)
        waiting = _pending_bytes(planner.batcher)
        in_use = planner.producer.budget.in_use
        queued = planner.batcher.stats()["pending"]
        most = await _drain(planner, sinks, len(plan.units))
        return plan, sinks, waiting, in_use, queued, most

    plan, sinks, waiting, in_use, queued, most = asyncio.run(run())
    assert len(plan.units) == 32
    assert 0 < queued < len(plan.units), "production should wait for the encoder, not queue every group"
    assert waiting <= budget and in_use >= waiting  # the queued rows are counted in the budget
    assert most <= budget
    assert not sinks.errors and len(sinks.rows) == len(plan.units)  # then everything is encoded
    budget_ = planner.producer.budget
    assert budget_.in_use == 0  # every hold given back
    budget_.check_integrity()
    planner.batcher.check_integrity()


def test_long_video_under_a_small_budget_finishes_while_the_encoder_runs(vision, pool):
    """The encoder consumes queued groups whatever the decoders do, so a video whose rows are many
    times the budget streams through it: decodes wait for the encoder, never for each other."""
    # 64 groups of rows, 1.9 MiB each, through 12 MiB. (The largest chunk, 6 frames, reserves
    # ~8.6 MiB; the video's idle open containers beside it are closed when it waits for their room:
    # test_budget_holders.py)
    budget = 12 * MIB
    planner = _planner(vision, pool, budget, max_frames=128)
    stop, most = threading.Event(), [0]

    def encoder() -> None:  # a slow encoder lane of its own
        while not stop.is_set():
            most[0] = max(most[0], _pending_bytes(planner.batcher))
            if not planner.batcher.run_due():
                time.sleep(0.002)

    async def run():
        data = video_bytes(n_frames=128, size=(320, 240), fps=10, gop=16)
        plan = await planner.plan(await planner.ingestor.ingest(MediaSource(data=data)))
        sinks = Sinks(len(plan.units))
        planner.start(plan, sinks.sinks)
        end = time.monotonic() + 90
        while (sinks.done < len(plan.units) or planner.producer._tasks) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return plan, sinks

    lane = threading.Thread(target=encoder, daemon=True)
    lane.start()
    try:
        plan, sinks = asyncio.run(run())
    finally:
        stop.set()
        lane.join(10)
    rows_total = sum(r.numel() for r in sinks.rows.values())
    assert len(plan.units) == 64 and not sinks.errors and len(sinks.rows) == 64
    assert rows_total > 0 and 0 < most[0] <= budget
    assert planner.producer.budget.in_use == 0
    planner.producer.budget.check_integrity()


def test_failed_production_gives_back_what_no_job_took(vision, pool, monkeypatch):
    """A chunk fails mid-video: the groups already queued are encoded (and release their rows), the
    rest fail, and nothing stays held in the budget."""
    planner = _planner(vision, pool, 64 * MIB)
    decoder = planner.producer.decoder
    real, calls = decoder.decode_chunk, [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise UndecodableMediaError("chunk 3 is damaged")
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder, "decode_chunk", flaky)

    async def run():
        data = video_bytes(n_frames=64, size=(160, 120), fps=10, gop=8)
        plan = await planner.plan(await planner.ingestor.ingest(MediaSource(data=data)))
        sinks = Sinks(len(plan.units))
        planner.start(plan, sinks.sinks)
        await _drain(planner, sinks, len(plan.units))
        return plan, sinks

    plan, sinks = asyncio.run(run())
    assert sinks.errors and sinks.done == len(plan.units)
    assert planner.producer.budget.in_use == 0
    planner.producer.budget.check_integrity()


def test_request_that_leaves_mid_video_gives_back_every_hold(vision, pool):
    """The request goes away while its video decodes under a full budget: the production is
    cancelled at the next frame (or budget wait), its queued rows are still encoded (for the
    cache) and released, and the budget ends empty."""
    budget = 8 * MIB
    planner = _planner(vision, pool, budget)

    async def run():
        plan, sinks = await _start_video(planner)
        planner.detach(plan, sinks.sinks)
        end = time.monotonic() + 30

        def outstanding() -> bool:  # a forward may still run (has_pending: waiting ones only) and
            # hold its rows' share until it ends: wait for the budget too, not just the queues
            return bool(planner.producer._tasks or planner.batcher.has_pending()
                        or planner.batcher.stats()["in_flight_units"] or planner.producer.budget.in_use)

        while outstanding() and time.monotonic() < end:
            planner.batcher.run_due(force=True)
            await asyncio.sleep(0.01)
        return plan

    asyncio.run(run())
    assert planner.producer.budget.in_use == 0
    planner.producer.budget.check_integrity()
    assert planner.batcher.stats()["in_flight_units"] == 0
