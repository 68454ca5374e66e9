"""Encoder queue order (encode/batcher.py, ``BatcherConfig.order``): requests take turns; on a CPU
encoder a newcomer's units are batched apart from those of requests already encoding, on an
accelerator they mix; ``arrival`` keeps one queue; the memory of served flows stays bounded. A
property test checks every batch against the rules under random traffic."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm_pipeline.encode.batcher as batcher_module
from mm_pipeline.encode.batcher import BatcherConfig, EncoderBatcher, EncoderJob
from mm_pipeline.encode.preprocess import VisionInput


class Tower:
    """A vision encoder that records each forward's keys and returns its inputs' rows; ``device``:
    where its one parameter lives (the batcher reads it to pick the CPU rule)."""

    def __init__(self, device: str = "cpu") -> None:
        self.weight = torch.empty(0, device=device)
        self.batches: list[list[str]] = []
        self._keys: dict[int, str] = {}
        self._lock = threading.Lock()

    def parameters(self):
        yield self.weight

    def encode_items(self, items):
        with self._lock:
            self.batches.append([self._keys[id(rows)] for rows, _ in items])
        return [rows.clone() for rows, _ in items]

    def job(self, key: str, flow: str | None, rows: int = 4, priority: int = 0) -> EncoderJob:
        x = torch.full((rows, 3), float(len(self._keys)))
        self._keys[id(x)] = key
        return EncoderJob(key, "video", vision=VisionInput(x, (1, 1, rows)), flow=flow, priority=priority)


def submit(b: EncoderBatcher, tower: Tower, got: dict, key: str, flow: str | None, **kw) -> None:
    assert b.attach(key, lambda rows, error: got.setdefault(key, []).append(rows if error is None else error))
    b.submit(tower.job(key, flow, **kw))


def batches_of(tower: Tower, b: EncoderBatcher, lanes: int = 1) -> list[list[str]]:
    start = len(tower.batches)
    while b.has_pending():
        assert b.run_due(lanes=lanes)
    b.check_integrity()
    return tower.batches[start:]


@pytest.mark.parametrize("device, order, expect", [
    ("cpu", "fair", [["img"], ["v2", "v3"]]),  # apart: the image does not wait for the video's rows
    ("meta", "fair", [["img", "v2", "v3"]]),  # an accelerator: the image goes first, the batch mixes
    ("cpu", "arrival", [["v2", "img", "v3"]]),  # one queue, arrival order
])
def test_a_newcomer_goes_first_and_apart_on_a_cpu_encoder(device, order, expect):
    tower = Tower(device)
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0, order=order))
    got: dict = {}
    for k in ("v0", "v1"):
        submit(b, tower, got, k, "video")
    assert batches_of(tower, b) == [["v0", "v1"]]  # the video is served now
    submit(b, tower, got, "v2", "video")
    submit(b, tower, got, "img", "image")
    submit(b, tower, got, "v3", "video")
    assert batches_of(tower, b) == expect
    assert all(len(got[k]) == 1 for k in ("v0", "v1", "v2", "v3", "img"))


@pytest.mark.parametrize("device, expect", [
    ("cpu", [["img"], ["w0", "w1", "w2", "w3"], ["v1", "v2"]]),
    ("meta", [["img", "w0", "w1", "w2", "w3", "v1", "v2"]]),
])
def test_a_new_videos_groups_do_not_hold_up_an_image_that_came_with_them(device, expect):
    """A new video and an image that came while one forward ran are both newcomers of one rank: the
    image (fewer rows queued) goes first, and on a CPU encoder the video's groups do not join its
    batch (they hold more rows than the image); then the new video, then the one served before."""
    tower = Tower(device)
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0))
    got: dict = {}
    submit(b, tower, got, "v0", "video")
    assert batches_of(tower, b) == [["v0"]]
    for k in ("v1", "v2"):
        submit(b, tower, got, k, "video")
    for k in ("w0", "w1", "w2", "w3"):
        submit(b, tower, got, k, "new-video")
    submit(b, tower, got, "img", "image", rows=6)
    assert batches_of(tower, b) == expect


def test_newcomers_batch_with_each_other():
    """A burst of single-image requests keeps its packed forwards (CPU rule: newcomers together)."""
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0))
    got: dict = {}
    submit(b, tower, got, "v0", "video")
    assert batches_of(tower, b) == [["v0"]]
    submit(b, tower, got, "v1", "video")
    for i, rows in enumerate((8, 3, 5, 2)):  # mixed sizes: each at most twice the smaller ones together
        submit(b, tower, got, f"img{i}", f"req{i}", rows=rows)
    assert batches_of(tower, b) == [["img3", "img1", "img2", "img0"], ["v1"]]  # fewest rows first


def test_flows_take_turns_and_a_newcomer_joins_just_before_the_flow_served_last():
    tower = Tower()
    # one job per forward: the budget holds one unit
    b = EncoderBatcher(tower, None, BatcherConfig(vision_budget=4, max_wait_s=0.0))
    got: dict = {}
    for i in range(3):
        submit(b, tower, got, f"a{i}", "A")
        submit(b, tower, got, f"b{i}", "B")
    assert b.run_due() == 1 and b.run_due() == 1  # a0 (the first newcomer), b0 (a newcomer before served A)
    submit(b, tower, got, "c0", "C")  # joins the round just before B, served last when it came
    assert [k for (k,) in batches_of(tower, b)] == ["a1", "c0", "b1", "a2", "b2"]
    assert tower.batches[:2] == [["a0"], ["b0"]]


def test_no_request_passes_one_whose_turn_came_first():
    """CPU: a batch ends at the first unit of the other kind (newcomer / served) in turn order, so a
    served request ranked after a waiting newcomer does not ride along with one ranked before it."""
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0))
    got: dict = {}
    for key, flow in (("a0", "A"), ("b0", "B")):  # A served, then B (B served last)
        submit(b, tower, got, key, flow)
        batches_of(tower, b)
    submit(b, tower, got, "a1", "A")
    submit(b, tower, got, "n0", "N")  # a newcomer: just before B
    submit(b, tower, got, "b1", "B")
    assert batches_of(tower, b) == [["a1"], ["n0"], ["b1"]]


def test_priority_goes_before_turns():
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(vision_budget=4, max_wait_s=0.0))
    got: dict = {}
    for i in range(2):
        submit(b, tower, got, f"low{i}", "low", priority=1)
    for i in range(2):
        submit(b, tower, got, f"high{i}", "high", priority=0)
    assert [k for (k,) in batches_of(tower, b)] == ["high0", "high1", "low0", "low1"]


def test_the_memory_of_served_flows_is_bounded(monkeypatch):
    monkeypatch.setattr(batcher_module, "REMEMBERED_FLOWS", 8)
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0))
    got: dict = {}
    submit(b, tower, got, "long0", "long")
    for i in range(40):  # many one-unit requests, each served once and never again
        submit(b, tower, got, f"r{i}", f"req{i}")
        batches_of(tower, b)
        assert len(b._turns["vision"]) <= 8
    b.check_integrity()
    # the flows without jobs ended are forgotten, the encoding one while it has jobs waiting is kept
    submit(b, tower, got, "long1", "long")
    assert "long" in b._turns["vision"]


def test_a_flow_just_served_is_remembered_past_the_bound(monkeypatch):
    """Trimming keeps the flows with jobs queued and those of the batch just taken: a video between
    two frame groups stays served, not a newcomer again."""
    monkeypatch.setattr(batcher_module, "REMEMBERED_FLOWS", 8)
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(vision_budget=4, max_wait_s=0.0))  # one unit per forward
    got: dict = {}
    for i in range(5):  # five requests served and gone, remembered
        submit(b, tower, got, f"old{i}", f"old{i}")
        batches_of(tower, b)
    submit(b, tower, got, "v-g0", "video")
    for i in range(4):  # four requests waiting behind it
        submit(b, tower, got, f"w{i}", f"w{i}", priority=1)
    assert b.run_due() == 1 and tower.batches[-1] == ["v-g0"]
    assert "video" in b._turns["vision"] and b._turns["vision"].served("video")
    assert len(b._turns["vision"]) <= 8
    b.check_integrity()


def test_a_unit_without_a_flow_is_a_flow_of_its_own():
    """Work not made for a request (no flow): each unit alone, so the queue keeps arrival order."""
    tower = Tower()
    b = EncoderBatcher(tower, None, BatcherConfig(max_wait_s=0.0))
    got: dict = {}
    for i in range(3):
        submit(b, tower, got, f"u{i}", None)
    assert batches_of(tower, b) == [["u0", "u1", "u2"]]


def test_the_order_is_checked():
    with pytest.raises(ValueError, match="order"):
        BatcherConfig(order="lifo")  # type: ignore[arg-type]


# ---- every batch against the rules, under random traffic ----------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 4), st.integers(1, 6)),  # flow, rows
    st.tuples(st.just("run"), st.integers(1, 2), st.booleans()),  # lanes, force
), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, budget=st.integers(4, 16), cpu=st.booleans())
def test_every_batch_follows_the_rules(ops, budget, cpu):
    """A batch on a CPU encoder holds newcomers only or served flows only; every unit is encoded
    once; and requests take turns: between two services of a flow with a job waiting -- or its
    arrival and its first -- no other flow is served twice."""
    tower = Tower("cpu" if cpu else "meta")
    b = EncoderBatcher(tower, None, BatcherConfig(vision_budget=budget, max_wait_s=0.0))
    got: dict = {}
    flow_of: dict[str, str] = {}
    served: set[str] = set()
    # per flow with a job waiting: how often each other flow was served since it waited or was served
    since: dict[str, dict[str, int]] = {}

    def check(batch: list[str]) -> None:
        flows = {flow_of[k] for k in batch}
        if cpu:
            assert len({f in served for f in flows}) == 1, (batch, served)
        for f, counts in since.items():
            if f not in flows:
                for g in flows:
                    counts[g] = counts.get(g, 0) + 1
                    assert counts[g] <= 1, f"{g} served twice while {f} waited"
        for f in flows:
            since.pop(f, None)
        served.update(flows)
        pending = {flow_of[k] for k in flow_of if k not in got}
        for f in pending:
            since.setdefault(f, {})

    n = 0
    for op in ops:
        if op[0] == "submit":
            key, flow = f"u{n}", f"f{op[1]}"
            n += 1
            flow_of[key] = flow
            since.setdefault(flow, {})
            submit(b, tower, got, key, flow, rows=op[2])
        else:
            start = len(tower.batches)
            b.run_due(lanes=op[1], force=op[2])
            for batch in tower.batches[start:]:
                check(batch)
        b.check_integrity()
    while b.has_pending():
        start = len(tower.batches)
        b.run_due(force=True)
        for batch in tower.batches[start:]:
            check(batch)
    assert sorted(got) == sorted(flow_of) and all(len(v) == 1 for v in got.values())
