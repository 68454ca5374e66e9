"""``--decode-backend process`` end to end: the flag reaches the runtime, a video and an image give
the same tokens as the thread backend, a broken file fails only its request, and shutting the
engine down leaves no shared-memory block."""

from __future__ import annotations

import asyncio
import glob

from tests.mm_pipeline.runtime.test_omni_engine import GREEDY, ask, ckpt, collect, image_part, make, video_part  # noqa: F401 (ckpt: fixture)
from tests.support.media_samples import image_bytes, video_bytes

from mm_pipeline import cli
from mm_pipeline.errors import UndecodableMediaError
from mm_pipeline.media.decode.backend import ProcessDecodeBackend, ThreadDecodeBackend

VIDEO = video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)
IMAGE = image_bytes(size=(96, 80))


def test_flag_selects_the_backend(tmp_path):
    cfg = cli.engine_config(cli.parse_args(["caption", str(tmp_path), "--decode-backend", "process",
                                            "--decode-workers", "3"]))
    assert (cfg.decode_backend, cfg.decode_workers) == ("process", 3)
    assert cli.engine_config(cli.parse_args(["caption", str(tmp_path)])).decode_backend == "thread"


def test_process_backend_gives_the_thread_backends_tokens(ckpt):
    answers = {}
    for backend in ("thread", "process"):
        engine = make(ckpt, decode_backend=backend)
        decoder = engine.runtime.decoder
        assert isinstance(decoder, ProcessDecodeBackend if backend == "process" else ThreadDecodeBackend)

        async def run():
            async def one(part):
                try:
                    return (await collect(engine, ask(part)))[0]
                except UndecodableMediaError as exc:
                    return exc
            return await asyncio.gather(one(video_part(VIDEO)), one(image_part(IMAGE)),
                                        one(image_part(IMAGE[:60])))
        try:
            answers[backend] = asyncio.run(run())
            assert engine.stats().media["video_chunks_decoded"] == 4
        finally:
            engine.shutdown()
        if backend == "process":
            assert glob.glob(f"/dev/shm/{decoder.prefix}*") == []
    video, image, broken = answers["process"]
    assert [video, image] == answers["thread"][:2] and len(video) == GREEDY.max_tokens
    assert isinstance(broken, UndecodableMediaError) and "png" in str(broken).lower()


def test_a_repeat_whose_units_left_the_cache_decodes_in_a_process(ckpt):
    """A repeated data URL is ingested without decoding it (a DeferredMediaItem from the source
    memo); when its units are no longer in the encoder cache (a 1-byte memory tier here), its
    chunks go to the worker processes like any other: same tokens both times, not a TypeError."""
    engine = make(ckpt, decode_backend="process", cache_memory_bytes=1)
    try:
        part = video_part(VIDEO)
        first = asyncio.run(collect(engine, ask(part)))[0]
        again = asyncio.run(collect(engine, ask(part)))[0]
        media = engine.stats().media
    finally:
        engine.shutdown()
    assert first == again and len(first) == GREEDY.max_tokens
    assert media["source_memo_hits.video"] == 1 and media["video_chunks_decoded"] == 8
    assert glob.glob(f"/dev/shm/{engine.runtime.decoder.prefix}*") == []
