"""Omni runtime end to end through OmniEngine on a tiny omni checkpoint: streamed video equals the
non-streamed reference, cache hits skip decode and encode, single flight under concurrency, a broken
file fails only its request, the disk tier survives a restart, disconnect aborts and frees, admission
limit and file resolver, the event loop stays responsive while videos decode, a mid-stream decode
failure fails its request and frees everything."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import pytest
from tests.support.encode_first import encode_first_tokens
from tests.support.media_samples import image_bytes, video_bytes

from encoders.video import preprocess_video
from llm_core import SamplingParams
from mm_pipeline.media.decode.video import VideoDecoder
from mm_pipeline.runtime.embedding_stream import PlaceholderSpan
from mm_pipeline.errors import MediaError, MediaNotFound, OverloadedError, UndecodableMediaError
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from mm_pipeline.server.errors import http_answer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def make(ckpt, **kw) -> OmniEngine:
    cfg = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
               max_num_batched_tokens=64, groups_per_chunk=1)
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(**{**cfg, **kw}))


def durl(data: bytes) -> str:
    return "data:;base64," + base64.b64encode(data).decode()


def ask(part: dict, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": durl(data)}}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": durl(data)}}


async def collect(engine: OmniEngine, messages, params=GREEDY, **kw):
    deltas = [d async for d in engine.generate(messages, params, **kw)]
    return [t for d in deltas for t in d.new_token_ids], deltas


def assert_idle(engine: OmniEngine) -> None:
    """Requests and unit claims back to empty, and no KV page held but by the prefix cache (on by
    default; aborts reach the engine thread async, and the stats snapshot it publishes may be one
    idle wake-up behind)."""
    def idle(s) -> bool:
        cached = s.llm.prefix_cache
        return (s.engine_loop_requests == 0 and s.llm.running == 0 and s.llm.queue_depth == 0
                and s.llm.kv_pool["full"].used_pages == cached.get("tree_full_pages", 0)
                and s.llm.kv_pool["swa"].used_pages == cached.get("tree_swa_pages", 0)
                and s.encoder["in_flight_units"] == 0 and s.encoder["pending"] == 0)

    deadline = time.monotonic() + 5
    while not idle(s := engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert idle(s), s
    engine.runtime.batcher.check_integrity()
    engine.runtime.cache.check_integrity()


VIDEO = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)  # 8 s -> 8 sampled frames -> 4 groups


def test_streamed_video_equals_non_streamed_reference(ckpt):
    engine = make(ckpt)
    try:
        tokens, deltas = asyncio.run(collect(engine, ask(video_part(VIDEO))))
        prompt = deltas[0].prompt_token_ids
        media = engine.stats().media
        assert media["video_chunks_decoded"] == 4  # streamed group by group
        assert 1 <= media["video_containers_opened"] <= 2  # the chunks share the 2 workers' containers
        # reference: decode everything, encode everything, then prefill with all rows ready
        model = engine.runtime.model
        item = MediaItem(MediaKind.VIDEO, "mp4", VIDEO)
        video = VideoDecoder(model.video_sampling).decode_sync(item)
        groups = preprocess_video(video.frames.permute(0, 3, 1, 2), video.timestamps, model.image_config)
        rows = model.vision.encode_items(groups.groups())
        pad = model.layout.prompt_layout.special.video_pad
        spans, i = [], 0
        while i < len(prompt):
            if prompt[i] == pad:
                j = i
                while j < len(prompt) and prompt[j] == pad:
                    j += 1
                spans.append(PlaceholderSpan(i, j, f"g{len(spans)}"))
                i = j
            else:
                i += 1
        assert len(spans) == groups.num_groups == 4
        assert tokens == encode_first_tokens(model.text, prompt, spans, rows, model.hidden_size, GREEDY)
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_repeat_media_skips_decode_and_encode(ckpt):
    engine = make(ckpt)
    try:
        img = image_bytes(size=(80, 60))
        cold, _ = asyncio.run(collect(engine, ask(image_part(img))))
        before = engine.stats()
        assert before.media["images_decoded"] == 1 and before.encoder["encoded.image"] == 1
        warm, _ = asyncio.run(collect(engine, ask(image_part(img))))  # same question: cache on == off
        asyncio.run(collect(engine, ask(image_part(img), "Another question?")))
        asyncio.run(collect(engine, ask(video_part(VIDEO))))
        asyncio.run(collect(engine, ask(video_part(VIDEO), "And now?")))
        after = engine.stats()
        assert warm == cold
        assert after.media["images_decoded"] == 1 and after.encoder["encoded.image"] == 1
        assert after.media["video_chunks_decoded"] == 4 and after.encoder["encoded.video"] == 4
        assert after.media["probes"] == 1  # the manifest gave the layout: no second probe
        # a repeated data URL is known by its text (source memo): not decoded, hashed or sniffed
        # again; the manifest gives its layout, per modality
        m = after.media
        assert m["content_hashes.image"] == 1 and m["content_hashes.video"] == 1
        assert m["source_memo_hits.image"] == 2 and m["source_memo_hits.video"] == 1
        assert m["sniff_probes.video"] == 1 and "sniff_probes.image" not in m  # one PyAV open to sniff
        assert m["manifest_misses.image"] == 1 and m["manifest_hits.image"] == 2
        assert m["manifest_misses.video"] == 1 and m["manifest_hits.video"] == 1
        # the cache counts encoder units (the two image repeats, the video's four groups), manifests apart
        assert after.encoder_cache_hits["memory"] == 2 * 1 + 4 * 1
        # a manifest is counted once per request (a cold item's one-hop try does not count its miss)
        assert after.encoder_cache["manifest_hits"] == 2 + 1 and after.encoder_cache["manifest_misses"] == 2
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_single_flight_under_concurrency(ckpt):
    engine = make(ckpt)
    try:
        img = image_bytes(size=(90, 70))

        async def many():
            return await asyncio.gather(*(collect(engine, ask(video_part(VIDEO), f"q{i}")) for i in range(4)),
                                        *(collect(engine, ask(image_part(img), f"q{i}")) for i in range(4)))

        results = asyncio.run(many())
        s = engine.stats()
        assert all(len(toks) == GREEDY.max_tokens for toks, _ in results)
        assert s.media["video_chunks_decoded"] == 4 and s.encoder["encoded.video"] == 4
        assert s.media["images_decoded"] == 1 and s.encoder["encoded.image"] == 1
        assert s.encoder["joins"] > 0  # requests really waited on units another one was producing
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_streaming_off_waits_for_every_unit_and_gives_the_same_tokens(ckpt):
    """``stream_embeddings=False``: the LLM request starts only when every unit is encoded; the
    tokens equal the streamed run's, and a broken file still fails just its request."""
    streamed, unstreamed = make(ckpt), make(ckpt, stream_embeddings=False)
    try:
        msgs = [{"role": "user", "content": [video_part(VIDEO), image_part(image_bytes(size=(64, 48))),
                                             {"type": "text", "text": "Compare."}]}]
        want, _ = asyncio.run(collect(streamed, msgs))
        got, deltas = asyncio.run(collect(unstreamed, msgs))
        assert got == want and len(got) == GREEDY.max_tokens
        assert unstreamed.stats().media["video_chunks_decoded"] == 4
        with pytest.raises(UndecodableMediaError):
            asyncio.run(collect(unstreamed, ask(image_part(image_bytes(size=(64, 64))[:60]))))
        assert_idle(unstreamed)
    finally:
        streamed.shutdown()
        unstreamed.shutdown()


@pytest.mark.parametrize("lanes", [1, 2])  # --encoder-lanes: one encoder thread or two side by side
def test_broken_file_fails_only_its_own_request(ckpt, lanes):
    engine = make(ckpt, encoder_lanes=lanes)
    good = image_bytes(size=(64, 64))
    broken = image_bytes(size=(64, 64))[:60]  # a PNG header, then nothing

    async def one(data):
        try:
            toks, _ = await collect(engine, ask(image_part(data)))
            return toks
        except MediaError as exc:
            return exc

    try:
        async def both():
            return await asyncio.gather(one(good), one(broken), one(b"not media at all"))

        ok, bad, junk = asyncio.run(both())
        assert isinstance(ok, list) and len(ok) == GREEDY.max_tokens
        assert isinstance(bad, UndecodableMediaError) and http_answer(type(bad)).status == 400 and "png" in str(bad).lower()
        assert isinstance(junk, MediaError) and http_answer(type(junk)).status == 415
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_disk_tier_survives_restart(ckpt, tmp_path):
    img = image_bytes(size=(72, 40))
    first = make(ckpt, cache_dir=str(tmp_path / "enc"))
    try:
        cold, _ = asyncio.run(collect(first, ask(image_part(img))))
        first.runtime.cache.flush()
    finally:
        first.shutdown()
    second = make(ckpt, cache_dir=str(tmp_path / "enc"))
    try:
        warm, _ = asyncio.run(collect(second, ask(image_part(img))))
        s = second.stats()
        assert warm == cold
        assert s.encoder_cache_hits["disk"] == 1 and s.encoder_cache["manifest_hits"] == 1  # the image's unit, its manifest
        assert s.media.get("images_decoded", 0) == 0 and s.encoder.get("encoded.image", 0) == 0
    finally:
        second.shutdown()


@pytest.mark.parametrize("lanes", [1, 2])
def test_disconnect_aborts_and_frees(ckpt, lanes):
    engine = make(ckpt, encoder_lanes=lanes)
    try:
        async def leave_early():
            agen = engine.generate(ask(video_part(VIDEO)), SamplingParams(max_tokens=200, ignore_eos=True))
            first = await agen.__anext__()
            await agen.aclose()  # the client went away
            return first

        first = asyncio.run(leave_early())
        assert first.new_token_ids
        assert_idle(engine)
        assert engine.stats().engine_loop["steps"] < 150  # stopped long before 200 tokens
    finally:
        engine.shutdown()


def test_cancelled_while_encoding_on_two_lanes_frees_everything(ckpt):
    """A request cancelled before its first token, while its frame groups decode and encode on two
    encoder lanes: claims, pending units, requests and KV pages all come back."""
    engine = make(ckpt, encoder_lanes=2)
    try:
        async def cancel_early(video: bytes, delay: float) -> bool:
            agen = engine.generate(ask(video_part(video)), GREEDY)
            try:
                await asyncio.wait_for(agen.__anext__(), timeout=delay)
                cancelled = False  # a fast host may answer in time: still freed
            except asyncio.TimeoutError:
                cancelled = True
            await agen.aclose()
            return cancelled

        cancelled = 0
        for k, delay in enumerate((0.005, 0.02, 0.05)):  # a new video each time: cold, nothing cached
            cancelled += asyncio.run(cancel_early(video_bytes(n_frames=90 + 10 * k, fps=10, size=(64, 48), gop=10),
                                                  delay))
            assert_idle(engine)
        assert cancelled >= 1  # 5 ms: no host decodes, encodes and prefills a video that fast
        tokens, _ = asyncio.run(collect(engine, ask(video_part(VIDEO))))  # the engine still serves
        assert len(tokens) == GREEDY.max_tokens
    finally:
        engine.shutdown()


def test_a_prompt_rejected_on_an_idle_engine_is_answered_at_once(ckpt):
    """The rejection is an output the engine holds from add_request on: the engine thread must step
    for it although nothing runs (it must not wait for another request to arrive)."""
    engine = make(ckpt, max_model_len=32)
    try:
        time.sleep(0.2)  # the engine thread is idle, waiting for a wake

        async def ask_too_long():
            return [d async for d in engine.generate_prompt(list(range(5, 45)), GREEDY)]

        t0 = time.monotonic()
        deltas = asyncio.run(asyncio.wait_for(ask_too_long(), timeout=5))
        assert time.monotonic() - t0 < 1.0
        assert [d.finish_reason for d in deltas] == ["error"] and "context limit of 32" in deltas[0].error
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_admission_limit_and_file_resolver(ckpt):
    engine = make(ckpt, max_queue=1)
    img = image_bytes(size=(64, 64))
    engine.set_file_resolver(lambda fid: (img, "x.png") if fid == "file-1" else (_ for _ in ()).throw(KeyError(fid)))
    try:
        async def run():
            first = engine.generate(ask({"type": "file", "file": {"file_id": "file-1"}}), GREEDY)
            d = await first.__anext__()
            with pytest.raises(OverloadedError) as info:
                await engine.generate(ask(image_part(img)), GREEDY).__anext__()
            assert http_answer(type(info.value)).status == 429
            rest = [x async for x in first]
            with pytest.raises(MediaNotFound, match="file-2"):
                await collect(engine, ask({"type": "file", "file": {"file_id": "file-2"}}))
            return [d] + rest

        deltas = asyncio.run(run())
        assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == GREEDY.max_tokens
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_event_loop_stays_responsive_while_videos_decode(ckpt):
    engine = make(ckpt)
    videos = [video_bytes(n_frames=60 + 10 * i, fps=10, size=(96, 64), gop=10) for i in range(6)]
    try:
        async def run():
            lags, stop = [], False

            async def ticker():
                while not stop:
                    t0 = time.perf_counter()
                    await asyncio.sleep(0.005)
                    lags.append(time.perf_counter() - t0 - 0.005)

            tick = asyncio.create_task(ticker())
            await asyncio.gather(*(collect(engine, ask(video_part(v))) for v in videos))
            stop = True
            await tick
            return max(lags)

        max_lag = asyncio.run(run())
        assert max_lag < 0.2, f"event loop blocked for {max_lag * 1000:.0f} ms"
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_mid_stream_decode_failure_fails_the_request_and_frees_everything(ckpt, monkeypatch):
    import mm_pipeline.media.decode.backend as backend_module  # the thread backend's decode_chunk

    real = backend_module.decode_chunk

    def flaky(item, info, indices, groups, tp, limits, *size_and_control, **options):
        if 2 in groups:  # the third frame group is damaged
            raise UndecodableMediaError("mp4 video: damaged packet in frame group 2")
        return real(item, info, indices, groups, tp, limits, *size_and_control, **options)

    monkeypatch.setattr(backend_module, "decode_chunk", flaky)
    engine = make(ckpt)
    other = video_bytes(n_frames=40, fps=10, size=(64, 48), gop=10)
    try:
        async def both():
            bad = collect(engine, ask(video_part(VIDEO)))
            good = collect(engine, ask(video_part(other)))  # 2 groups: never reaches group 2
            return await asyncio.gather(bad, good, return_exceptions=True)

        bad, good = asyncio.run(both())
        assert isinstance(bad, UndecodableMediaError) and "frame group 2" in str(bad)
        assert len(good[0]) == GREEDY.max_tokens
        assert engine.stats().encoder.get("failed_units", 0) >= 1
        assert_idle(engine)
    finally:
        engine.shutdown()
