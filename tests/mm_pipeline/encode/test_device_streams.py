"""Device tensors handed between threads' CUDA streams (mm_pipeline/encode/device_streams.py).

On CPU: the encoder batcher marks every job's input as read by its forward's stream, and the
encoder worker's hook gets the forward's rows before they are delivered. On CUDA (skipped without
one; `.ci/gpu` runs them on a GPU machine): a media worker's preprocessing and its copy of cached
rows to the device run beside a default stream held busy by a long kernel (as by an LLM step) and
hand over finished rows; a tensor another stream reads (the encoder's inputs, the LLM's rows)
keeps its block until that stream's work is done; and the encoder on its own stream gives the
tokens of the encoder inline on the engine thread."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
import torch
from tests.support.media_samples import image_bytes, video_bytes

from encoders.image_processing import ImageProcessingConfig
from llm_core import SamplingParams
from mm_pipeline.encode import batcher as batcher_module
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.encode.device_streams import SideStream, read_by
from mm_pipeline.encode.preprocess import Preprocessor, VisionInput
from mm_pipeline.media.types import DecodedImage
from mm_pipeline.runtime.encoder_worker import EncoderWorker
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (.ci/gpu runs it on a GPU machine)")
BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: ~1 s of one GPU thread spinning at ~2 GHz


class _Tower:
    """Vision tower stand-in: one row per unit, the sum of its patch rows."""

    device = torch.device("cpu")

    def encode_items(self, items):
        return [rows.sum(0, keepdim=True) for rows, _ in items]


def test_batcher_marks_inputs_read_and_hands_rows_to_the_hook_before_delivery(monkeypatch):
    read, events = [], []
    monkeypatch.setattr(batcher_module, "read_by", lambda tensors: read.extend(tensors))
    b = EncoderBatcher(_Tower(), None, BatcherConfig(max_wait_s=10.0))
    b.before_deliver = lambda outs: events.append(("hook", [o.tolist() for o in outs]))
    rows = [torch.full((4, 3), float(k)) for k in range(2)]
    for k in range(2):
        assert b.attach(f"k{k}", lambda r, e, k=k: events.append(("delivered", k)))
        b.submit(EncoderJob(f"k{k}", "image", VisionInput(rows[k], (1, 2, 2))))
    assert b.run_due(force=True) == 2
    assert [id(t) for t in read] == [id(r) for r in rows]  # each input, as the forward's stream reads it
    assert events == [("hook", [[[0.0] * 3], [[4.0] * 3]]), ("delivered", 0), ("delivered", 1)]


def test_side_streams_pickle_without_their_streams():
    import pickle

    s = pickle.loads(pickle.dumps(SideStream("cpu")))
    with s.finished():  # CPU: the body only
        x = torch.ones(2) + 1
    assert s.device == torch.device("cpu") and x.tolist() == [2.0, 2.0]


# ---- CUDA ----------------------------------------------------------------------------------
def _beside_busy_default_stream(work) -> dict:
    """Run ``work(out, timed)`` on a worker thread twice: once to warm up (kernels loaded, the side
    stream's blocks cached), then while this thread's default stream runs ~1 s of GPU spinning (an
    LLM step stand-in); ``out["default_busy"]``: whether that was still running when the timed
    pass returned."""
    warmed, busy = threading.Event(), threading.Event()
    out: dict = {}

    def run() -> None:
        work(out, False)
        warmed.set()
        busy.wait(30)
        out.clear()
        work(out, True)
        out["default_busy"] = not torch.cuda.default_stream().query()

    t = threading.Thread(target=run)
    t.start()
    assert warmed.wait(60)
    torch.cuda._sleep(BUSY_CYCLES)  # on this thread's current stream: the default one
    busy.set()
    t.join(30)
    assert out.get("default_busy") is True, "the worker's device work waited for the default stream"
    return out


def _read_back(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies to the CPU on a stream of their own, which waits for nothing: rows whose kernels were
    still queued when handed over would read as stale or garbage."""
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        got = [t.to("cpu") for t in tensors]
    torch.cuda.synchronize()
    return got


@cuda
def test_preprocessing_beside_a_busy_default_stream_hands_over_finished_rows(monkeypatch):
    """A media worker's preprocessing returns while the default stream is still busy (it did not
    queue behind it) with complete rows: its side-stream work is slowed by a spin first, and the
    rows read back on a third stream equal the CPU path's for this pass's frames (the warm-up pass
    had other frames)."""
    gen = torch.Generator().manual_seed(3)
    warm, timed = (torch.randint(0, 256, (4, 64, 96, 3), dtype=torch.uint8, generator=gen) for _ in range(2))
    cfg = ImageProcessingConfig(min_pixels=32 * 32, max_pixels=64 * 96)
    want_video = torch.cat([u.rows for u in Preprocessor(cfg).video_groups(timed, (64, 96))])
    want_image = Preprocessor(cfg).image(DecodedImage(timed[0], "png"), size=(32, 64)).rows
    pre = Preprocessor(cfg, device="cuda")
    patchify = pre._patchify

    def slow_patchify(*args):  # on the side stream, before the kernels whose rows are handed over
        torch.cuda._sleep(BUSY_CYCLES // 10)
        return patchify(*args)

    def work(out: dict, is_timed: bool) -> None:
        frames = timed if is_timed else warm
        if is_timed:
            monkeypatch.setattr(pre, "_patchify", slow_patchify)
        out["video"] = [u.rows for u in pre.video_groups(frames, (64, 96))]
        out["image"] = pre.image(DecodedImage(frames[0], "png"), size=(32, 64)).rows

    out = _beside_busy_default_stream(work)
    *video, image = _read_back([*out["video"], out["image"]])
    torch.testing.assert_close(torch.cat(video), want_video, rtol=0, atol=1e-6)
    torch.testing.assert_close(image, want_image, rtol=1e-5, atol=1e-4)  # resized: GPU vs CPU bilinear


@cuda
def test_cached_rows_reach_the_device_beside_a_busy_default_stream():
    """Rows read back from the encoder cache's tiers (CPU) are copied to the device by the worker
    without waiting for the default stream, complete when returned."""
    pre = Preprocessor(ImageProcessingConfig(), device="cuda")
    rows = {False: torch.randn(300, 64), True: torch.randn(300, 64)}

    def work(out: dict, is_timed: bool) -> None:
        out["rows"] = pre.cached_rows(rows[is_timed])

    out = _beside_busy_default_stream(work)
    assert out["rows"].is_cuda and torch.equal(_read_back([out["rows"]])[0], rows[True])


@cuda
def test_a_block_read_by_a_busy_stream_is_not_reused_until_it_is_done():
    producer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        t = torch.empty(1 << 20, device="cuda")
    ptr = t.data_ptr()
    with torch.cuda.stream(reader):
        torch.cuda._sleep(BUSY_CYCLES)
    read_by([t], reader)
    del t
    with torch.cuda.stream(producer):
        u = torch.empty(1 << 20, device="cuda")
    assert u.data_ptr() != ptr  # without read_by the producer's next tensor would take the block at once
    torch.cuda.synchronize()


@cuda
def test_delivered_encoder_rows_are_kept_until_the_default_stream_is_done():
    """The encoder worker's rows, read by the LLM on the default stream (busy here), keep their
    block after the last reference goes until that stream's queued work is done."""
    worker = EncoderWorker(EncoderBatcher(_Tower(), None, BatcherConfig()), "cuda")
    with torch.cuda.stream(worker._stream):
        t = torch.empty(1 << 20, device="cuda")
    ptr = t.data_ptr()
    torch.cuda._sleep(BUSY_CYCLES)  # the default stream: a prefill reading the rows stand-in
    worker.deliver_ready([t])
    del t
    with torch.cuda.stream(worker._stream):
        u = torch.empty(1 << 20, device="cuda")
    assert u.data_ptr() != ptr
    torch.cuda.synchronize()


GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _part(kind: str, data: bytes) -> dict:
    return {"type": f"{kind}_url", f"{kind}_url": {"url": "data:;base64," + base64.b64encode(data).decode()}}


@cuda
def test_encoder_stream_tokens_equal_the_inline_encoder_on_cuda(tmp_path):
    """float32 on CUDA: the encoder worker on its own stream (default) and the encoder inline on
    the engine thread give the same greedy tokens for a video and an image request together."""
    ckpt = build_tiny_omni_checkpoint(tmp_path / "m")
    chats = [[{"role": "user", "content": [_part("video", video_bytes(n_frames=80, fps=10, size=(64, 48), gop=10)),
                                           {"type": "text", "text": "What happens?"}]}],
             [{"role": "user", "content": [_part("image", image_bytes(size=(80, 60))),
                                           {"type": "text", "text": "Describe."}]}]]

    def run(**kw) -> list[list[int]]:
        cfg = OmniEngineConfig.from_kwargs(device="cuda", dtype="float32", page_size=4, num_full_tokens=4096,
                                           num_swa_tokens=2048, max_chunk_tokens=16, max_num_batched_tokens=64,
                                           groups_per_chunk=1, **kw)
        engine = OmniEngine.from_pretrained(ckpt, cfg)

        async def one(messages) -> list[int]:
            return [t async for d in engine.generate(messages, GREEDY) for t in d.new_token_ids]

        async def both() -> list[list[int]]:
            return list(await asyncio.gather(*(one(m) for m in chats)))

        try:
            return asyncio.run(both())
        finally:
            engine.shutdown()

    inline = run(encoder_worker=False)
    assert run() == inline and all(len(t) == GREEDY.max_tokens for t in inline)
