"""The prompt is laid out before anything is encoded, so the placeholder count of every unit must be
exactly the number of rows its encoder later outputs. Pinned end to end for images, video frame
groups and audio of various sizes: real media bytes -> MediaPlanner (sizes from
``encoders.config.unit_tokens``) -> PromptLayout spans, against the rows the tiny towers produce
for the same units through the batcher."""

from __future__ import annotations

import asyncio

import pytest
import torch

from encoders.audio.encoder import AudioEncoder
from encoders.image_processing import ImageProcessingConfig
from encoders.vision.tower import VisionTransformer
from llm_core.storage import MemoryStore
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.encode.planner import MediaPlanner
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.types import MediaSource
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.media.worker_pool import WorkerPool
from mm_pipeline.prompt.layout import PromptLayout
from samples.checkpoints.tiny_omni import processor_config, tiny_special_tokens
from samples.checkpoints.tiny_towers import init_random_, tiny_audio_config, tiny_vision_config
from tests.support.media_samples import audio_bytes, image_bytes, video_bytes

SPECIAL = tiny_special_tokens()
PLACEHOLDER = {"image": [SPECIAL.vision_start, SPECIAL.image_pad, SPECIAL.vision_end],
               "video": [SPECIAL.vision_start, SPECIAL.video_pad, SPECIAL.vision_end],
               "audio": [SPECIAL.audio_start, SPECIAL.audio_pad, SPECIAL.audio_end]}


@pytest.fixture(scope="module")
def planner():
    vision_cfg, audio_cfg = tiny_vision_config(), tiny_audio_config()
    vision = init_random_(VisionTransformer(vision_cfg), 0).eval()
    audio = init_random_(AudioEncoder(audio_cfg), 1).eval()
    pre = Preprocessor(ImageProcessingConfig.from_dict(processor_config(SPECIAL, vision_cfg, audio_cfg)), audio_cfg)
    pool = WorkerPool(2, 16)
    planner = MediaPlanner(pre, EncoderCache([MemoryStore(1 << 24)]),
                           EncoderBatcher(vision, audio, BatcherConfig(max_wait_s=10.0)), pool,
                           MediaIngestor(IngestConfig(), pool), "tiny-towers",
                           PlannerConfig(video_sampling=VideoSamplingParams(fps=2.0, min_frames=2, max_frames=16),
                                         groups_per_chunk=1))
    yield planner
    pool.shutdown()


def laid_out_and_encoded(planner: MediaPlanner, data: bytes) -> tuple[str, list[int], list[int]]:
    """(kind, placeholder tokens per unit, encoder rows per unit) of one media item."""

    async def run() -> tuple[str, list[int], list[int]]:
        plan = await planner.plan(await planner.ingestor.ingest(MediaSource(data=data)))
        kind = plan.kind.value
        laid = PromptLayout(SPECIAL, lambda s: [ord(c) for c in s]).expand(PLACEHOLDER[kind], [plan.slots])
        got: dict[int, torch.Tensor] = {}

        def sink(i: int):
            def deliver(rows, error) -> None:
                if error is not None:
                    raise error
                got[i] = rows
            return deliver

        planner.start(plan, [sink(i) for i in range(len(plan.units))])
        while len(got) < len(plan.units):  # the engine loop's part: run the batches as they fill
            await asyncio.sleep(0.005)
            planner.batcher.run_due(force=True)
        return kind, [b - a for a, b in laid.unit_spans[0]], [int(got[i].shape[0]) for i in range(len(got))]

    return asyncio.run(run())


@pytest.mark.parametrize("size", [(64, 48), (33, 97), (300, 200), (40, 400), (129, 31)])
def test_image_placeholders_equal_encoder_rows(planner, size):
    kind, laid, encoded = laid_out_and_encoded(planner, image_bytes("PNG", size))
    assert kind == "image" and len(laid) == 1 and laid == encoded


@pytest.mark.parametrize("n_frames,size", [(6, (64, 48)), (23, (96, 160)), (40, (50, 30))])
def test_video_group_placeholders_equal_encoder_rows(planner, n_frames, size):
    kind, laid, encoded = laid_out_and_encoded(planner, video_bytes(n_frames=n_frames, size=size))
    assert kind == "video" and len(laid) >= 1 and laid == encoded


@pytest.mark.parametrize("seconds", [0.05, 0.2, 1.2, 2.5])
def test_audio_segment_placeholders_equal_encoder_rows(planner, seconds):
    kind, laid, encoded = laid_out_and_encoded(planner, audio_bytes(rate=24000, seconds=seconds, channels=1))
    assert kind == "audio" and laid == encoded
    assert len(laid) == -(-(1 + int(seconds * 24000) // 240) // planner.pre.audio_config.segment_size)
