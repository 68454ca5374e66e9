"""Video with sound: the reference's interleaved layout (docs/model.md §5.3) sliced by time and split
at segment boundaries, per-segment caching, streamed == unstreamed == an encode-first reference,
a sound track that does not decode leaves the frames served, and ``video_audio=False``."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import torch
from tests.support.encode_first import encode_first_tokens
from tests.support.media_samples import video_bytes

from llm_core import SamplingParams
from mm_pipeline.model.config import SpecialTokens
from mm_pipeline.prompt.layout import MediaSlots, PromptLayout, audio_slices
from mm_pipeline.runtime.embedding_stream import PlaceholderSpan
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# 8 s at 10 fps with an AAC track: 4 frame groups at 0, 2, 4, 6 s; 801 mel frames -> 8 segments of
# 96 frames (6 tokens) + one of 33 (3 tokens) = 51 sound tokens at 6.25 per second
MOVIE = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10, with_audio=True)


def test_audio_slices_follow_the_reference_rule():
    assert audio_slices((0.0, 2.0, 4.0, 6.0), 51, 6.25) == (12, 13, 12, 14)  # int(2*6.25)=12, int(4*6.25)=25...
    assert audio_slices((0.0, 2.0, 4.0), 10, 6.25) == (10, 0, 0)  # a short track: later groups hear nothing
    assert audio_slices((0.0, 2.0, 2.0), 40, 6.25) == (12, 0, 28)  # a repeated (padded) timestamp
    assert sum(audio_slices((0.0, 1.0, 3.0, 3.5), 77, 6.25)) == 77


def test_layout_interleaves_sound_by_time_and_splits_at_segments():
    sp = SpecialTokens(**{name: 1000 + i for i, name in enumerate(SpecialTokens().as_dict())})
    layout = PromptLayout(sp, lambda text: [ord(c) for c in text])
    slots = MediaSlots("video", (2, 2), (0.0, 2.0), audio_tokens=(8, 7), audio_per_second=6.25)
    laid = layout.expand([7, sp.vision_start, sp.video_pad, sp.vision_end, 9], [slots])
    ids = list(laid.token_ids)
    V, A = [sp.video_pad] * 2, sp.audio_pad
    ts0, ts1 = [ord(c) for c in "00:00"], [ord(c) for c in "00:02"]
    assert ids == ([7, sp.video_start] + ts0 + [sp.vision_start, *V, sp.vision_end, sp.audio_start] + [A] * 12
                   + [sp.audio_end] + ts1 + [sp.vision_start, *V, sp.vision_end, sp.audio_start] + [A] * 3
                   + [sp.audio_end, sp.video_end, 9])
    # spans: group 0, sound seg 0 (8), seg 1 rows 0-3, group 1, seg 1 rows 4-6
    assert laid.pieces(0) == ((0, 0), (2, 0), (3, 0), (1, 0), (3, 4))
    lengths = [e - s for s, e in laid.unit_spans[0]]
    assert lengths == [2, 8, 4, 2, 3]
    assert [ids[s] for s, _ in laid.unit_spans[0]] == [sp.video_pad, A, A, sp.video_pad, A]
    assert laid.unit_spans[0][2][0] == laid.unit_spans[0][1][1]  # seg 1 starts where seg 0 ends
    with pytest.raises(ValueError, match="sound track"):
        MediaSlots("image", (4,), audio_tokens=(3,), audio_per_second=6.25)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("vs") / "m", seed=6, audio_path="reference")


def make(ckpt, **kw) -> OmniEngine:
    cfg = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
               max_num_batched_tokens=64, groups_per_chunk=1)
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(**{**cfg, **kw}))


def ask(data: bytes, text: str = "Describe.") -> list[dict]:
    url = "data:;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


async def collect(engine: OmniEngine, messages):
    deltas = [d async for d in engine.generate(messages, GREEDY)]
    return [t for d in deltas for t in d.new_token_ids], deltas


def test_video_with_sound_streams_caches_and_matches_an_encode_first_reference(ckpt):
    streamed, unstreamed = make(ckpt), make(ckpt, stream_embeddings=False)
    try:
        tokens, deltas = asyncio.run(collect(streamed, ask(MOVIE)))
        prompt = deltas[0].prompt_token_ids
        model = streamed.runtime.model
        sp = model.layout.prompt_layout.special
        s = streamed.stats()
        assert s.encoder["encoded.video"] == 4 and s.encoder["encoded.audio"] == 9
        assert prompt.count(sp.audio_pad) == 51 and prompt.count(sp.audio_start) == 4
        # order in the prompt: each group's frames, then its sound
        first_audio = prompt.index(sp.audio_start)
        assert prompt.index(sp.video_pad) < first_audio < prompt.index(sp.vision_start, first_audio)

        # reference: every unit encoded first (frames and sound from the planner's own inputs path)
        got, _ = asyncio.run(collect(unstreamed, ask(MOVIE)))
        assert got == tokens
        plan = asyncio.run(_plan(unstreamed, MOVIE))
        rows_v, rows_a = _encode_all(unstreamed, plan)
        spans, fills = [], []
        runs = _pad_runs(prompt, {sp.video_pad, sp.audio_pad})
        sound = torch.cat(rows_a)
        cursor = g = 0
        for start, end in runs:
            spans.append(PlaceholderSpan(start, end, str(len(spans))))
            if prompt[start] == sp.video_pad:
                fills.append(rows_v[g])
                g += 1
            else:
                fills.append(sound[cursor:cursor + end - start])
                cursor += end - start
        assert cursor == sound.shape[0] == 51
        assert tokens == encode_first_tokens(model.text, prompt, spans, fills, model.hidden_size, GREEDY)

        # the same video again: every frame group and sound segment from the cache, no decode
        asyncio.run(collect(streamed, ask(MOVIE, "And the sound?")))
        after = streamed.stats()
        assert after.encoder["encoded.audio"] == 9 and after.encoder["encoded.video"] == 4
        assert after.media["audio_decoded"] == 1
    finally:
        streamed.shutdown()
        unstreamed.shutdown()


def test_undecodable_sound_leaves_the_frames_and_the_switch_turns_sound_off(ckpt, monkeypatch):
    from mm_pipeline.encode.unit_producer import UnitProducer
    from mm_pipeline.errors import UndecodableMediaError

    off = make(ckpt, video_audio=False)
    try:
        silent_tokens, deltas = asyncio.run(collect(off, ask(MOVIE)))
        sp = off.runtime.model.layout.prompt_layout.special
        assert sp.audio_pad not in deltas[0].prompt_token_ids
        assert off.stats().media.get("audio_decoded", 0) == 0
    finally:
        off.shutdown()

    def broken(self, item, *args, **kwargs):
        raise UndecodableMediaError("the aac stream is damaged")

    monkeypatch.setattr(UnitProducer, "audio_inputs", broken)
    engine = make(ckpt)
    try:
        tokens, deltas = asyncio.run(collect(engine, ask(MOVIE)))
        assert sp.audio_pad not in deltas[0].prompt_token_ids and tokens == silent_tokens
        assert engine.stats().media["video_sound_dropped"] == 1
    finally:
        engine.shutdown()


# ---- helpers ------------------------------------------------------------------------------------
async def _plan(engine: OmniEngine, data: bytes):
    from mm_pipeline.media.types import MediaItem, MediaKind

    planner = engine.runtime.planner
    return await planner.plan(MediaItem(MediaKind.VIDEO, "mp4", data))


def _encode_all(engine: OmniEngine, plan):
    """Frame groups and sound segments decoded and encoded here, one unit per forward."""
    from mm_pipeline.media.decode.video_chunks import decode_chunk

    runtime = engine.runtime
    pre, model = runtime.pre, runtime.model
    info, sampling, size = runtime.planner.producer.probe_video(plan.item)
    groups = len(plan.units) - plan.audio_units
    frames = decode_chunk(plan.item, info, sampling.indices, list(range(groups)), 2,
                          runtime.planner.config.limits, size)
    rows_v = [model.vision.encode_items([(v.rows, v.grid)])[0] for v in pre.video_groups(frames, size)]
    mels = runtime.planner.producer.audio_inputs(plan.item)
    rows_a = [model.audio.encode_segments([m])[0] for m in mels]
    return rows_v, rows_a


def _pad_runs(prompt, pads):
    runs, i = [], 0
    while i < len(prompt):
        if prompt[i] in pads:
            j = i
            while j < len(prompt) and prompt[j] == prompt[i]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def test_the_checkpoint_declares_whether_videos_are_heard(ckpt):
    """processor_config.use_audio_in_video decides the default (true when absent, as MiMo-V2.5); the
    demo model, trained on videos that beep, declares true; a checkpoint declaring false is heard
    without sound; the engine flag overrides both."""
    from mm_pipeline.model.config import OmniConfig
    from tests.support.paths import DEMO_MODEL

    assert OmniConfig.from_pretrained(ckpt).video_audio is True
    assert OmniConfig.from_pretrained(DEMO_MODEL).video_audio is True
    import json
    import shutil

    silent = ckpt.parent / f"{ckpt.name}-silent"
    if not silent.exists():
        shutil.copytree(ckpt, silent)
        cfg = json.loads((silent / "config.json").read_text())
        cfg.setdefault("processor_config", {})["use_audio_in_video"] = False
        (silent / "config.json").write_text(json.dumps(cfg))
    assert OmniConfig.from_pretrained(silent).video_audio is False
    sampling = OmniConfig.from_pretrained(ckpt).video
    assert OmniEngineConfig().planner_config(sampling, default_video_audio=False).video_audio is False
    assert OmniEngineConfig().planner_config(sampling, default_video_audio=True).video_audio is True
    assert OmniEngineConfig(video_audio=True).planner_config(sampling, default_video_audio=False).video_audio is True
    assert OmniEngineConfig(video_audio=False).planner_config(sampling, default_video_audio=True).video_audio is False
