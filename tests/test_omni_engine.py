"""Omni runtime: encoder batcher (cross-request batching, single flight, failures), preprocessing,
chat parsing; end to end through OmniEngine on a tiny omni checkpoint (cache hits skip decode and
encode, single flight under concurrency, a broken file fails only its request, disk tier survives
a restart, disconnect aborts and frees, the event loop stays responsive while videos decode)."""

from __future__ import annotations

import threading

import pytest
import torch

from encoders.audio import AudioEncoder
from encoders.image_processing import ImageProcessingConfig, preprocess_image
from encoders.tiny import init_random_, tiny_audio_config, tiny_vision_config
from encoders.vision import VisionTransformer
from mm_pipeline.chat_request import InvalidMessageError, MediaRef, parse_messages
from mm_pipeline.encoder_batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.media import DecodedImage, MediaKind
from mm_pipeline.preprocess import Preprocessor, VisionInput


@pytest.fixture(scope="module")
def towers():
    vision = init_random_(VisionTransformer(tiny_vision_config()), 0).eval()
    audio = init_random_(AudioEncoder(tiny_audio_config()), 1).eval()
    return vision, audio


def vision_input(seed: int, h: int, w: int) -> VisionInput:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    pre = Preprocessor(ImageProcessingConfig(min_pixels=32 * 32, max_pixels=128 * 128))
    return pre.image(DecodedImage(pixels, "png"))


class Collector:
    def __init__(self):
        self.got: dict[str, list] = {}
        self.lock = threading.Lock()

    def sink(self, name: str):
        def f(rows, error):
            with self.lock:
                self.got.setdefault(name, []).append(rows if error is None else error)
        return f


# ---- encoder batcher ---------------------------------------------------------------------------
def test_batches_across_requests_and_equals_one_by_one(towers):
    vision, audio = towers
    encoded = {}
    b = EncoderBatcher(vision, audio, BatcherConfig(max_wait_s=10.0),
                       on_encoded=lambda k, r: encoded.__setitem__(k, r))
    col = Collector()
    inputs = {f"img{i}": vision_input(i, 40 + 16 * i, 70 - 8 * i) for i in range(3)}
    mels = {f"aud{i}": torch.randn(30 + 20 * i, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    for k, v in inputs.items():  # three "requests", one unit each
        assert b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "image", vision=v))
    for k, m in mels.items():
        assert b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "audio", mel=m))
    assert b.run_due() == 0  # not due yet: waiting for company, budget not reached
    assert b.run_due(force=True) == 5
    stats = b.stats()
    assert stats["forwards.vision"] == 1 and stats["forwards.audio"] == 1  # one forward per encoder
    for k, v in inputs.items():
        ref = vision.encode_items([(v.rows, v.grid)])[0]
        torch.testing.assert_close(col.got[k][0], ref, rtol=1e-5, atol=1e-5)
        assert encoded[k] is col.got[k][0]
    for k, m in mels.items():
        torch.testing.assert_close(col.got[k][0], audio.encode_segments([m])[0], rtol=1e-5, atol=1e-5)
    assert stats["in_flight_units"] == 0 and not b.has_pending()
    b.check_integrity()


def test_budget_splits_batches_and_due_time(towers):
    vision, _ = towers
    v = vision_input(0, 64, 64)  # 16 patch rows
    b = EncoderBatcher(vision, None, BatcherConfig(vision_budget=2 * v.num_patches, max_wait_s=10.0))
    col = Collector()
    for i in range(5):
        b.attach(f"k{i}", col.sink(f"k{i}"))
        b.submit(EncoderJob(f"k{i}", "image", vision=v))
    # budget reached -> due without waiting; 2 jobs fit per forward; one forward per call (the
    # engine loop runs an LLM step in between), then the last job waits for company
    assert b.run_due() == 2 and b.run_due() == 2 and b.run_due() == 0
    assert b.stats()["forwards.vision"] == 2 and b.has_pending()
    assert b.next_due() is not None
    assert b.run_due(force=True) == 1 and len(col.got) == 5


def test_single_flight_join_and_failure_reaches_everyone(towers):
    vision, _ = towers
    b = EncoderBatcher(vision, None)
    col = Collector()
    assert b.attach("x", col.sink("a")) is True
    assert b.attach("x", col.sink("b")) is False  # joined
    assert b.wanted("x")
    b.fail("x", ValueError("broken frame"))
    assert [type(e) for e in col.got["a"] + col.got["b"]] == [ValueError, ValueError]
    assert not b.wanted("x") and b.stats()["in_flight_units"] == 0
    assert b.attach("x", col.sink("c")) is True  # nothing poisoned: the next one claims again
    b.submit(EncoderJob("x", "image", vision=vision_input(1, 32, 32)))
    b.run_due(force=True)
    assert isinstance(col.got["c"][0], torch.Tensor)
    with pytest.raises(ValueError, match="without being claimed"):
        b.submit(EncoderJob("y", "image", vision=vision_input(1, 32, 32)))


def test_missing_encoder_and_detach(towers):
    vision, _ = towers
    b = EncoderBatcher(vision, None)
    col = Collector()
    b.attach("s", col.sink("s"))
    b.submit(EncoderJob("s", "audio", mel=torch.zeros(10, 32)))
    assert "no audio encoder" in str(col.got["s"][0])
    sink = col.sink("d")
    b.attach("d", sink)
    b.detach("d", sink)
    assert not b.wanted("d")
    b.submit(EncoderJob("d", "image", vision=vision_input(2, 32, 32)))
    b.run_due(force=True)
    assert "d" not in col.got and b.stats()["in_flight_units"] == 0
    with pytest.raises(ValueError, match="unknown encoder job kind"):
        EncoderJob("z", "smell", mel=torch.zeros(1, 1))


# ---- preprocessing -----------------------------------------------------------------------------
def test_preprocess_matches_encoders_reference_and_metadata_sizes():
    cfg = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=96 * 96)
    pre = Preprocessor(cfg, tiny_audio_config())
    pixels = torch.randint(0, 256, (50, 77, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    got = pre.image(DecodedImage(pixels, "png"))
    rows, grid = preprocess_image(pixels.permute(2, 0, 1).float(), cfg)
    torch.testing.assert_close(got.rows, rows)
    assert got.grid == grid
    h, w = pre.image_size(50, 77)
    assert pre.tokens_for_size(h, w) == got.num_patches // 4
    # video groups: one input per pair of frames, same size for all
    frames = torch.randint(0, 256, (4, 40, 60, 3), dtype=torch.uint8)
    size = pre.video_size(40, 60, 4)
    groups = pre.video_groups(frames, size)
    assert len(groups) == 2 and all(g.grid == (1, size[0] // 16, size[1] // 16) for g in groups)
    with pytest.raises(ValueError, match="multiple of 2"):
        pre.video_groups(frames[:3], size)
    # audio: per-segment token counts from the sample count alone
    cfg_a = tiny_audio_config()
    samples = 240 * 250
    assert sum(pre.audio_segment_tokens(samples)) == cfg_a.num_tokens(cfg_a.num_mel_frames(samples))


# ---- chat parsing ------------------------------------------------------------------------------
def test_parse_messages_parts_and_errors():
    chat = parse_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "video_url", "video_url": {"url": "/abs/video.mp4"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-1"}},
            {"type": "text", "text": "what?"}]},
    ])
    media = chat.media
    assert [m.kind for m in media] == [MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO, None]
    assert media[1].source.path == "/abs/video.mp4" and media[3].file_id == "file-1"
    assert chat.turns[1].parts[-1] == "what?"
    for bad, msg in [([], "non-empty list"), ([{"role": "robot", "content": "x"}], "role"),
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x"}}]}],
                      "unsupported URL"),
                     ([{"role": "user", "content": [{"type": "hologram"}]}], "unsupported type"),
                     ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "base64")]:
        with pytest.raises(InvalidMessageError, match=msg) as info:
            parse_messages(bad)
        assert info.value.status == 400
    with pytest.raises(ValueError):
        MediaRef(MediaKind.IMAGE)


# ---- video chunk plan --------------------------------------------------------------------------
def test_video_chunks_follow_keyframes():
    from mm_pipeline.video_chunks import plan_chunks

    indices = list(range(0, 40, 2))  # 20 sampled frames -> 10 groups, group g = frames 4g, 4g+2
    every8 = tuple(range(0, 40, 8))
    # keyframe every 8 source frames: each chunk of 2 groups (8 frames) starts at its own keyframe
    assert plan_chunks(range(10), indices, every8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # one keyframe only: every later chunk would re-decode from frame 0 -> one chunk
    assert plan_chunks(range(10), indices, (0,), 2, 2) == [list(range(10))]
    # cached groups (2, 3) leave a gap: the run restarts after it
    assert plan_chunks([0, 1, 4, 5, 6], indices, every8, 2, 2) == [[0, 1], [4, 5], [6]]
    # a keyframe a little before each chunk: re-decoding the small overlap beats losing the stream
    late = (0, 6, 14)  # chunk 1 (frames 8..14) seeks to 6, chunk 2 (16..22) to 14: overlap 1 frame
    assert plan_chunks(range(6), indices, late, 2, 2) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="groups_per_chunk"):
        plan_chunks([0], indices, every8, 2, 0)


# ---- end to end through OmniEngine ---------------------------------------------------------------
import asyncio  # noqa: E402
import base64  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from encoders.video import preprocess_video  # noqa: E402
from llm_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from media_samples import image_bytes, video_bytes  # noqa: E402
from mm_pipeline.decode_video import VideoDecoder  # noqa: E402
from mm_pipeline.embedding_stream import EmbeddingStream, PlaceholderSpan  # noqa: E402
from mm_pipeline.errors import MediaError, MediaNotFound, UndecodableMediaError  # noqa: E402
from mm_pipeline.media import MediaItem  # noqa: E402
from mm_pipeline.omni_checkpoint import build_tiny_omni_checkpoint  # noqa: E402
from mm_pipeline.omni_engine import OmniEngine, OmniEngineConfig, OverloadedError  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "m")


def make(ckpt, **kw) -> OmniEngine:
    cfg = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_chunk_tokens=16,
               max_num_batched_tokens=64, groups_per_chunk=1)
    return OmniEngine.from_pretrained(ckpt, OmniEngineConfig(**{**cfg, **kw}))


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
    """Pools, requests and unit claims back to empty (aborts reach the engine thread async)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["requests"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            break
        time.sleep(0.01)
    assert s["requests"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert s["kv_pool"]["full"]["used_pages"] == 0 and s["kv_pool"]["swa"]["used_pages"] == 0
    assert s["encoder"]["in_flight_units"] == 0 and s["encoder"]["pending"] == 0
    engine.runtime.batcher.check_integrity()
    engine.runtime.cache.check_integrity()


VIDEO = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)  # 8 s -> 8 sampled frames -> 4 groups


def test_streamed_video_equals_non_streamed_reference(ckpt):
    engine = make(ckpt)
    try:
        tokens, deltas = asyncio.run(collect(engine, ask(video_part(VIDEO))))
        prompt = deltas[0].prompt_token_ids
        assert engine.stats()["media"]["video_chunks_decoded"] == 4  # streamed group by group
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
        stream = EmbeddingStream(len(prompt), spans, model.hidden_size)
        for k, r in enumerate(rows):
            stream.fill(k, r)
        llm = LLMEngine(model.text, EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048))
        llm.add_request("ref", prompt, GREEDY, embeds=stream)
        ref = None
        while ref is None:
            ref = next((o for o in llm.step() if o.finished), None)
        assert tokens == ref.token_ids
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_repeat_media_skips_decode_and_encode(ckpt):
    engine = make(ckpt)
    try:
        img = image_bytes(size=(80, 60))
        cold, _ = asyncio.run(collect(engine, ask(image_part(img))))
        before = engine.stats()
        assert before["media"]["images_decoded"] == 1 and before["encoder"]["encoded.image"] == 1
        warm, _ = asyncio.run(collect(engine, ask(image_part(img))))  # same question: cache on == off
        asyncio.run(collect(engine, ask(image_part(img), "Another question?")))
        asyncio.run(collect(engine, ask(video_part(VIDEO))))
        asyncio.run(collect(engine, ask(video_part(VIDEO), "And now?")))
        after = engine.stats()
        assert warm == cold
        assert after["media"]["images_decoded"] == 1 and after["encoder"]["encoded.image"] == 1
        assert after["media"]["video_chunks_decoded"] == 4 and after["encoder"]["encoded.video"] == 4
        assert after["media"]["probes"] == 1  # the manifest gave the layout: no second probe
        assert after["encoder_cache"]["memory"]["hits"] >= 2 * 2 + 4 * 1 + 1
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
        assert s["media"]["video_chunks_decoded"] == 4 and s["encoder"]["encoded.video"] == 4
        assert s["media"]["images_decoded"] == 1 and s["encoder"]["encoded.image"] == 1
        assert s["encoder"]["joins"] > 0  # requests really waited on units another one was producing
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_broken_file_fails_only_its_own_request(ckpt):
    engine = make(ckpt)
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
        assert isinstance(bad, UndecodableMediaError) and bad.status == 400 and "png" in str(bad).lower()
        assert isinstance(junk, MediaError) and junk.status == 415
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
        assert s["encoder_cache"]["disk"]["hits"] >= 2  # the manifest and the image embedding
        assert s["media"].get("images_decoded", 0) == 0 and s["encoder"].get("encoded.image", 0) == 0
    finally:
        second.shutdown()


def test_disconnect_aborts_and_frees(ckpt):
    engine = make(ckpt)
    try:
        async def leave_early():
            agen = engine.generate(ask(video_part(VIDEO)), SamplingParams(max_tokens=200, ignore_eos=True))
            first = await agen.__anext__()
            await agen.aclose()  # the client went away
            return first

        first = asyncio.run(leave_early())
        assert first.new_token_ids
        assert_idle(engine)
        assert engine.stats()["engine_loop"]["steps"] < 150  # stopped long before 200 tokens
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
            assert info.value.status == 429
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


# ---- incremental detokenizer -------------------------------------------------------------------
def test_detokenizer_deltas_concatenate_to_the_final_text():
    from mm_pipeline.detokenizer import IncrementalDetokenizer
    from mm_pipeline.omni_checkpoint import build_tiny_tokenizer, tiny_special_tokens

    tok = build_tiny_tokenizer(tiny_special_tokens())
    text = "héllo wörld → ok"
    ids = tok.encode(text, add_special_tokens=False)  # bytes: 'é', 'ö', '→' span several tokens
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    assert "".join(pieces) + d.finish(None) == text
    assert all("\ufffd" not in p for p in pieces)  # a split character is sent once complete
    # stop strings: nothing past the stop is ever sent; the engine's cut text settles the end
    d = IncrementalDetokenizer(tok, stop=("wör",))
    sent = "".join(d.push([i]) for i in ids[:tok.encode("héllo wö", add_special_tokens=False).__len__()])
    assert "wö" not in sent and text.startswith(sent)
    assert sent + d.finish("héllo ") == "héllo "


def test_mid_stream_decode_failure_fails_the_request_and_frees_everything(ckpt, monkeypatch):
    import mm_pipeline.unit_producer as producer_module

    real = producer_module.decode_chunk

    def flaky(item, info, indices, groups, tp, limits):
        if 2 in groups:  # the third frame group is damaged
            raise UndecodableMediaError("mp4 video: damaged packet in frame group 2")
        return real(item, info, indices, groups, tp, limits)

    monkeypatch.setattr(producer_module, "decode_chunk", flaky)
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
        assert engine.stats()["encoder"].get("failed_units", 0) >= 1
        assert_idle(engine)
    finally:
        engine.shutdown()
