"""Bytes the decode budget counts outside a decode's own reservation: a video's idle open containers
(given up when a reservation needs the room) and the log-mels an audio clip or a video's sound
track decoded at planning (the cold path: counted from their decode until encoded or dropped)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch

from encoders.audio.encoder import AudioEncoder
from encoders.image_processing import ImageProcessingConfig
from encoders.vision.tower import VisionTransformer
from llm_core.storage import MemoryStore
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import MediaPlan, PlannerConfig
from mm_pipeline.encode.planner import MediaPlanner
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.encode.unit_producer import UnitProducer
from mm_pipeline.media.decode.budget import DecodeBudget, DecodeControl
from mm_pipeline.media.decode.decoder_memory import frame_decode_bytes
from mm_pipeline.media.decode.video_chunks import VideoContainers
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem, MediaKind, MediaSource
from mm_pipeline.media.worker_pool import WorkerPool
from samples.checkpoints.tiny_towers import init_random_, tiny_audio_config, tiny_vision_config
from tests.support.media_samples import audio_bytes, video_bytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def towers():
    return (init_random_(VisionTransformer(tiny_vision_config()), 0).eval(),
            init_random_(AudioEncoder(tiny_audio_config()), 1).eval())


@pytest.fixture()
def pool():
    pool = WorkerPool(2, 16)
    yield pool
    pool.shutdown()


# ---- idle containers --------------------------------------------------------------------------------
def test_a_chunk_needing_the_bytes_of_its_videos_idle_container_goes_on(pool):
    """A one-group chunk leaves its container idle (held in the budget); the next chunk, three
    groups, fits the budget alone but not beside that container, which only a chunk borrowing it
    gives back -- after its reservation. Before, the chunk waited out its deadline (5 s here, then
    MediaDecodeTimeout) beside bytes nobody used."""
    producer = UnitProducer(Preprocessor(ImageProcessingConfig()), pool, EncoderBatcher(None, None),
                            EncoderCache([MemoryStore(1 << 20)]), PlannerConfig(decoder_threads=1),
                            lambda *a, **k: None)
    item = MediaItem(MediaKind.VIDEO, "mp4", video_bytes("mp4", "mpeg4", fps=10, n_frames=80, size=(320, 240), gop=10))
    info, sampling, size = producer.probe_video(item)
    tp = producer.pre.image_config.temporal_patch_size
    idle = frame_decode_bytes(info, producer.config.decoder_threads)
    large = producer.chunk_bytes(item, info, 3 * tp, size)
    producer.budget = DecodeBudget(large + idle // 2)
    containers = VideoContainers(item, producer.budget, idle)
    assert len(producer._video_chunk(item, info, sampling.indices, [0], size, tp, containers=containers)) == 1
    assert producer.budget.in_use == producer.budget.early_in_use == idle  # kept idle
    out = producer._video_chunk(item, info, sampling.indices, [1, 2, 3], size, tp,
                                DecodeControl(5.0, what="the next chunk"), containers=containers)
    assert len(out) == 3 and containers.opened == 2
    containers.close()
    assert producer.budget.in_use == 0
    producer.budget.check_integrity()


# ---- log-mels decoded at planning -----------------------------------------------------------------
def _planner(towers, pool) -> MediaPlanner:
    limits = MediaLimits(max_decoded_bytes_in_flight=256 * MIB, decode_timeout_s=60.0)
    vision, audio = towers
    batcher = EncoderBatcher(vision, audio, BatcherConfig(max_wait_s=0.0))
    return MediaPlanner(Preprocessor(ImageProcessingConfig(), tiny_audio_config()), EncoderCache([MemoryStore(1 << 24)]),
                        batcher, pool, MediaIngestor(IngestConfig(limits=limits), pool), "tiny",
                        PlannerConfig(limits=limits, video_sampling=VideoSamplingParams(fps=2.0, max_frames=8)))


def _mel_bytes(plan: MediaPlan) -> int:
    """Bytes of the planned log-mels (the segments of one clip are views of one tensor)."""
    sound = [plan.inputs[i] for i in range(len(plan.units)) if plan.is_audio_unit(i)]
    assert sound and all(isinstance(m, torch.Tensor) for m in sound)
    return sum({m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for m in sound}.values())


_MEDIA = {
    "audio": lambda: audio_bytes(rate=24000, seconds=6.0, channels=1),
    "video-sound": lambda: video_bytes(n_frames=40, size=(64, 48), fps=10, with_audio=True),
}


@pytest.mark.parametrize("kind", list(_MEDIA))
def test_log_mels_decoded_at_planning_stay_counted_until_encoded(towers, pool, kind):
    """The planning pass decodes an audio clip (or a video's sound track) to log-mels that wait in
    the plan, then in the encoder queue. Before, their reservation ended with the planning pass
    and the mels waited beside the budget (0 bytes counted here)."""
    planner = _planner(towers, pool)
    budget = planner.producer.budget
    got: dict[str, int] = {}

    async def run() -> None:
        plan = await planner.plan(await planner.ingestor.ingest(MediaSource(data=_MEDIA[kind]())))
        got["mels"], got["after_plan"] = _mel_bytes(plan), budget.in_use
        delivered: dict[int, object] = {}
        sinks = [lambda rows, err, i=i: delivered.__setitem__(i, err if err is not None else rows)
                 for i in range(len(plan.units))]
        planner.start(plan, sinks)
        end = time.monotonic() + 60
        while (len(delivered) < len(plan.units) or planner.producer._tasks) and time.monotonic() < end:
            planner.batcher.run_due(force=True)
            await asyncio.sleep(0.005)
        assert all(isinstance(r, torch.Tensor) for r in delivered.values()) and len(delivered) == len(plan.units)

    asyncio.run(run())
    assert got["mels"] > 0
    assert got["after_plan"] == got["mels"], f"counted {got['after_plan']} of {got['mels']} bytes of log-mels"
    assert budget.in_use == 0  # every unit encoded: its share given back
    budget.check_integrity()


def test_a_plan_dropped_unproduced_gives_its_log_mels_bytes_back(towers, pool):
    """A request may drop its plans without producing them (over a request budget, another item
    failing, the client leaving): the planned mels' bytes go with the mels."""
    planner = _planner(towers, pool)
    budget = planner.producer.budget

    async def plan() -> MediaPlan:
        return await planner.plan(await planner.ingestor.ingest(MediaSource(data=_MEDIA["audio"]())))

    plans = [asyncio.run(plan())]
    mels = _mel_bytes(plans[0])
    joined = MediaPlan(plans[0].item, plans[0].media_key, plans[0].units, inputs=plans[0].inputs, held=plans[0].held)
    assert budget.in_use == mels > 0
    plans.clear()
    gc.collect()
    assert budget.in_use == mels  # a joined plan still holds the mels
    del joined
    gc.collect()
    assert budget.in_use == 0
    budget.check_integrity()
