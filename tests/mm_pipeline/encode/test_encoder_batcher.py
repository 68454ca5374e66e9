"""Encoder batcher: cross-request batching equals one-by-one encoding, the budget splits batches and
sets the due time, pending work is visible, single flight (join, failure reaches every waiter), a
missing encoder, detach."""

from __future__ import annotations

import threading

import pytest
import torch

from encoders.audio.encoder import AudioEncoder
from encoders.image_processing import ImageProcessingConfig
from samples.checkpoints.tiny_towers import init_random_, tiny_audio_config, tiny_vision_config
from encoders.vision.tower import VisionTransformer
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.errors import UndecodableMediaError
from mm_pipeline.media.types import DecodedImage
from mm_pipeline.encode.preprocess import Preprocessor, VisionInput
from mm_pipeline.server.errors import http_answer


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
    assert stats["in_flight_units"] == 0 and stats["pending"] == 0
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
    assert b.stats()["forwards.vision"] == 2 and b.stats()["pending"] == 1
    assert b.next_due() is not None
    assert b.run_due(force=True) == 1 and len(col.got) == 5


def test_a_lane_takes_its_share_of_the_queue(towers):
    """``run_due(lanes=n)``: one of n encoder lanes takes at most ceil(pending / n) jobs (within the
    budget), so the other lanes find work; every job is taken once and the rows equal one-by-one."""
    vision, _ = towers
    inputs = {f"k{i}": vision_input(i, 48 + 16 * (i % 2), 64) for i in range(5)}
    b = EncoderBatcher(vision, None, BatcherConfig(max_wait_s=0.0))
    col = Collector()
    for k, v in inputs.items():
        b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "video", vision=v))
    assert b.run_due(lanes=2) == 3  # ceil(5 / 2)
    assert b.run_due(lanes=2) == 1 and b.run_due(lanes=2) == 1  # ceil(2 / 2), then the last one
    assert b.run_due(lanes=2) == 0 and b.stats()["forwards.vision"] == 3
    for k, v in inputs.items():
        assert len(col.got[k]) == 1
        torch.testing.assert_close(col.got[k][0], vision.encode_items([(v.rows, v.grid)])[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lanes"):
        b.run_due(lanes=0)


def test_has_pending_until_the_jobs_run(towers):
    """``has_pending`` (the streamed prefill's "encoder work queued" signal) holds from submit until
    the jobs are taken for a forward."""
    vision, _ = towers
    v = vision_input(0, 64, 64)
    b = EncoderBatcher(vision, None, BatcherConfig(max_wait_s=10.0))
    col = Collector()
    assert not b.has_pending()
    for i in range(2):
        b.attach(f"k{i}", col.sink(f"k{i}"))
        b.submit(EncoderJob(f"k{i}", "video", vision=v))
    assert b.run_due() == 0 and b.has_pending()  # waiting for company (10 s)
    assert b.run_due(force=True) == 2 and not b.has_pending() and sorted(col.got) == ["k0", "k1"]


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


def test_a_forward_that_fails_fails_only_the_unit_that_broke_it(towers):
    """Three requests' images packed into one forward; the tower raises on one of them. Before,
    every unit of the batch failed; now the batch is encoded again one unit at a time and only
    the culprit fails, the others get the rows a forward of their own gives."""
    vision, _ = towers
    inputs = {f"img{i}": vision_input(i, 40 + 16 * i, 70 - 8 * i) for i in range(3)}
    bad = inputs["img1"].rows

    class Fragile:
        def __init__(self):
            self.calls = []

        def encode_items(self, items):
            self.calls.append(len(items))
            if any(rows is bad for rows, _ in items):
                raise RuntimeError("kernel fault")
            return vision.encode_items(items)
    fragile = Fragile()
    b = EncoderBatcher(fragile, None, BatcherConfig(max_wait_s=10.0))
    col = Collector()
    for k, v in inputs.items():
        assert b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "image", vision=v))
    assert b.run_due(force=True) == 2, fragile.calls
    assert fragile.calls == [3, 1, 1, 1]
    assert "kernel fault" in str(col.got["img1"][0])
    for k in ("img0", "img2"):
        (alone,) = vision.encode_items([(inputs[k].rows, inputs[k].grid)])
        assert torch.equal(col.got[k][0], alone)
    assert b.stats()["in_flight_units"] == 0 and b.stats()["failed_units"] == 1


def test_non_finite_rows_fail_their_own_unit_and_are_never_cached(towers):
    """Three requests' audio segments in one packed forward, the middle one's log-mel holding NaN
    (a float WAV with a NaN sample). Only that unit fails, as bad media (HTTP 400) naming the
    problem; its NaN rows never reach the encoder cache, and its neighbours get the rows they get
    alone. Before, the NaN unit was cached and delivered, and its NaN leaked into the neighbours."""
    _, audio = towers
    g = torch.Generator().manual_seed(7)
    mels = {"a": torch.randn(37, 32, generator=g), "bad": torch.randn(40, 32, generator=g),
            "c": torch.randn(50, 32, generator=g)}
    mels["bad"][0, 0] = mels["bad"][-1, 5] = float("nan")
    cached = {}
    b = EncoderBatcher(None, audio, BatcherConfig(max_wait_s=10.0), on_encoded=cached.__setitem__)
    col = Collector()
    for k, m in mels.items():
        assert b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "audio", mel=m))
    assert b.run_due(force=True) == 2
    err = col.got["bad"][0]
    assert isinstance(err, UndecodableMediaError) and "non-finite" in str(err)
    assert http_answer(type(err)).status == 400
    assert set(cached) == {"a", "c"}
    assert all(torch.isfinite(rows).all() for rows in cached.values())
    for k in ("a", "c"):
        assert torch.allclose(col.got[k][0], audio.encode_segments([mels[k]])[0], atol=1e-5, rtol=1e-5)
    stats = b.stats()
    assert stats["failed_units"] == 1 and stats["encoded.audio"] == 2 and stats["in_flight_units"] == 0


def test_a_unit_spoilt_by_its_batch_is_encoded_again_alone(towers):
    """Defence in depth: should a packed forward ever give NaN rows to a unit whose input is finite
    (a leak between items, an overflow), those rows are not cached or delivered; the unit is
    encoded again alone and gets those rows. A unit that is non-finite alone with a finite input
    fails as an encoder failure, still uncached."""
    vision, _ = towers
    inputs = {f"img{i}": vision_input(i, 40 + 16 * i, 70 - 8 * i) for i in range(3)}
    victim, broken = inputs["img1"].rows, inputs["img2"].rows

    class Leaky:
        def __init__(self):
            self.calls = []

        def encode_items(self, items):
            self.calls.append(len(items))
            outs = vision.encode_items(items)
            for (rows, _), out in zip(items, outs):
                if rows is broken or (rows is victim and len(items) > 1):
                    out[0, 0] = float("nan")
            return outs
    leaky = Leaky()
    cached = {}
    b = EncoderBatcher(leaky, None, BatcherConfig(max_wait_s=10.0), on_encoded=cached.__setitem__)
    col = Collector()
    for k, v in inputs.items():
        assert b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "image", vision=v))
    assert b.run_due(force=True) == 2
    assert leaky.calls == [3, 1, 1]  # the packed forward, then img1 and img2 alone
    assert set(cached) == {"img0", "img1"}
    (alone,) = vision.encode_items([(victim, inputs["img1"].grid)])
    assert torch.equal(col.got["img1"][0], alone) and cached["img1"] is col.got["img1"][0]
    err = col.got["img2"][0]
    assert isinstance(err, RuntimeError) and "not finite" in str(err)
    assert b.stats()["failed_units"] == 1 and b.stats()["in_flight_units"] == 0


def test_a_batch_takes_the_most_urgent_jobs_first_and_keeps_arrival_order_within_one(towers):
    vision, _ = towers
    v = vision_input(0, 64, 64)
    b = EncoderBatcher(vision, None, BatcherConfig(vision_budget=2 * v.num_patches, max_wait_s=0.0))
    col = Collector()
    ranks = {"a": 5, "b": 0, "c": 5, "d": -1, "e": 0}
    for k, rank in ranks.items():
        b.attach(k, col.sink(k))
        b.submit(EncoderJob(k, "image", vision=v, priority=rank))
    order = []
    while b.has_pending():
        before = set(col.got)
        assert b.run_due() <= 2  # the budget still splits the batches
        order.append(set(col.got) - before)
    assert order == [{"d", "b"}, {"e", "a"}, {"c"}]  # by (priority, arrival): d b | e a | c
    assert b.stats()["pending"] == 0 and all(len(col.got[k]) == 1 for k in ranks)
