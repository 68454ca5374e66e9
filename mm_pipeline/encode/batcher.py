"""Cross-request encoder batching with single-flight units.

A *unit* is what one encoder call produces for one cache key: an image, one video frame group or
one audio segment. Its life:

    attach(key, sink) ──first──► claimed: the caller must produce it (decode, preprocess)
           │                         └─ submit(job) ──► pending[modality] ──run_due()──► forward
           └──later──► joined: sink waits for the same result                     │
                                                                                  ▼
    every sink of the key gets the rows (or the error); on_encoded(key, rows) writes the cache

Pending work of all requests is grouped by encoder (the vision tower takes images and video frame
groups together, the audio encoder takes segments) and run as one packed forward once the batch
reaches its token budget or its oldest job has waited ``max_wait_s``.

Which jobs a batch takes: encode/batch_order.py (``BatcherConfig.order``: requests take turns by
default, or one queue in arrival order). ``run_due`` runs on the
encoder worker's lanes (runtime/encoder_worker.py: one thread, or several side by side, each taking
its share of the queue) or, with the worker off, on the engine thread between LLM steps; a job
leaves the queue under the lock, so each is encoded by exactly one caller. Everything is
thread-safe.

Claims, joins and delivery are one ``SingleFlight`` over unit keys (the same mechanism media
planning uses). Invariant: a key is claimed in ``_units`` from ``attach`` until its result or error
is delivered; a pending job's key is always claimed.

A job's input may still be counted in the decode budget (``EncoderJob.release``, see
media/decode/budget.py): the batcher calls it exactly once, when it is done with the job -- after
the job's batch is through its forward (rows delivered, an error, the units of a failing or
non-finite pack encoded again one by one), or when ``submit`` refuses the job. So decoders wait for
the encoder instead of queueing rows beyond the budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from mm_pipeline.encode.batch_order import arrival_batch, fair_batch
from mm_pipeline.encode.device_streams import read_by
from mm_pipeline.encode.preprocess import VisionInput
from mm_pipeline.encode.single_flight import SingleFlight, Waiter
from mm_pipeline.errors import UndecodableMediaError
from mm_pipeline.media.flows import Turns

log = logging.getLogger(__name__)
UnitSink = Waiter[torch.Tensor]
VISION_KINDS = ("image", "video")


@dataclass(frozen=True, eq=False)
class EncoderJob:
    """One unit to encode: vision patch rows + grid, or one audio segment: a log-mel, or the
    segment's pre-tokenized RVQ codes [frames, channels] (the reference audio path only)."""

    key: str
    kind: str  # "image" | "video" | "audio"
    vision: VisionInput | None = None
    mel: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    flow: Hashable | None = None  # the claiming request (None: the unit is a flow of its own)
    priority: int = 0  # the claiming request's: lower is encoded first (module doc)
    # gives the decode budget back the bytes of this input (None: not counted there)
    release: Callable[[], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind in VISION_KINDS:
            if self.vision is None or self.mel is not None or self.codes is not None:
                raise ValueError(f"{self.kind} job {self.key[:16]} needs vision input only")
        elif self.kind == "audio":
            if (self.mel is None) == (self.codes is None) or self.vision is not None:
                raise ValueError(f"audio job {self.key[:16]} needs a mel segment or its codes only")
        else:
            raise ValueError(f"unknown encoder job kind {self.kind!r} (image, video, audio)")

    @property
    def encoder(self) -> str:
        return "audio" if self.kind == "audio" else "vision"

    @property
    def cost(self) -> int:
        """Budget units: patch rows (vision), mel frames (audio) or code frames (pre-tokenized
        audio: no tokenizer forward, a quarter of the frames of its sound)."""
        if self.vision is not None:
            return self.vision.num_patches
        return int((self.mel if self.mel is not None else self.codes).shape[0])  # type: ignore[union-attr]

    @property
    def turn_key(self) -> Hashable:
        """Whose turn the job waits for: its flow, or the unit alone."""
        return self.flow if self.flow is not None else ("unit", self.key)


@dataclass(frozen=True)
class BatcherConfig:
    vision_budget: int = 16384  # patch rows per vision forward
    audio_budget: int = 24000  # mel frames per audio forward
    max_wait_s: float = 0.005  # how long the oldest pending job may wait for company
    order: Literal["fair", "arrival"] = "fair"  # encode/batch_order.py

    def __post_init__(self) -> None:
        if self.vision_budget < 1 or self.audio_budget < 1 or self.max_wait_s < 0:
            raise ValueError(f"BatcherConfig needs positive budgets and max_wait_s >= 0, got {self}")
        if self.order not in ("fair", "arrival"):
            raise ValueError(f"BatcherConfig order must be 'fair' or 'arrival', got {self.order!r}")


# flows remembered per encoder queue between their visits (a video's frame groups arrive one by one
# as they decode, and must find their flow served, not a newcomer again); past it the idle flows
# served longest ago are forgotten
REMEMBERED_FLOWS = 1024


class EncoderBatcher:
    """Owns the pending encoder work of every request and the sinks waiting for each unit."""

    def __init__(self, vision: torch.nn.Module | None, audio: torch.nn.Module | None,
                 config: BatcherConfig = BatcherConfig(),
                 on_encoded: Callable[[str, torch.Tensor], None] | None = None,
                 on_submit: Callable[[], None] | None = None) -> None:
        self.vision = vision
        self.audio = audio
        self.config = config
        self.on_encoded = on_encoded
        self.on_submit = on_submit
        # called with a forward's rows before they are delivered: the encoder worker waits for its
        # CUDA stream here, so no consumer on another stream reads rows still being written
        # (encode/device_streams.py)
        self.before_deliver: Callable[[Sequence[torch.Tensor]], None] | None = None
        self.on_forward_span: Callable[[float, float], None] | None = None  # (start, end): a stage timeline
        self._lock = threading.Lock()  # guards _pending, _counts and _turns
        self._units: SingleFlight[torch.Tensor] = SingleFlight()
        self._pending: dict[str, deque[EncoderJob]] = {"vision": deque(), "audio": deque()}
        self._counts: Counter[str] = Counter()
        # per encoder queue: the flows' round-robin ranks, and whether its encoder runs on the CPU,
        # where newcomers batch apart (encode/batch_order.py)
        self._turns = {"vision": Turns(), "audio": Turns()}
        self._cpu = {name: _on_cpu(module) for name, module in (("vision", vision), ("audio", audio))}

    # ---- claims and sinks -------------------------------------------------------------------
    def attach(self, key: str, sink: UnitSink) -> bool:
        """Register ``sink`` for ``key``. True: nobody produces it yet, the caller now must
        (``submit`` or ``fail``); False: it joined a unit already in flight."""
        claimed = self._units.join(key, sink)
        with self._lock:
            self._counts["claims" if claimed else "joins"] += 1
        return claimed

    def detach(self, key: str, sink: UnitSink) -> None:
        """The sink's request ended; it gets nothing more (the unit itself still completes)."""
        self._units.leave(key, sink)

    def wanted(self, key: str) -> bool:
        """Does any request still wait for ``key``? (producers skip work nobody wants)"""
        return self._units.wanted(key)

    def submit(self, job: EncoderJob) -> None:
        """Queue a claimed unit for the next batch of its encoder (the job's ``release`` is the
        batcher's to call from here on)."""
        if (self.vision if job.encoder == "vision" else self.audio) is None:
            _release([job])
            self.fail(job.key, ValueError(f"this model has no {job.encoder} encoder for a {job.kind} input"))
            return
        if job.key not in self._units:
            _release([job])
            raise ValueError(f"unit {job.key[:16]} was submitted without being claimed")
        with self._lock:
            self._pending[job.encoder].append(job)
            self._turns[job.encoder].arrive(job.turn_key)
        if self.on_submit is not None:
            self.on_submit()

    def complete(self, key: str, rows: torch.Tensor) -> None:
        """The producer of ``key`` found its rows elsewhere (the cache): every sink gets them."""
        self._deliver(key, rows, None)

    def fail(self, key: str, error: BaseException) -> None:
        """The producer of ``key`` could not make its input: every sink gets ``error``."""
        self._deliver(key, None, error)

    # ---- engine-thread side -----------------------------------------------------------------
    def next_due(self) -> float | None:
        """monotonic() time at which the oldest pending job becomes due (None: nothing pending)."""
        with self._lock:
            heads = [q[0].submitted_at for q in self._pending.values() if q]
        return min(heads) + self.config.max_wait_s if heads else None

    def run_due(self, force: bool = False, lanes: int = 1) -> int:
        """Run one batch of every encoder whose batch is full or whose oldest job is due (every
        pending job with ``force``); returns the number of units encoded. One batch per encoder
        per call, so the engine loop interleaves LLM steps: prefill of early frame groups overlaps
        the encoding of later ones instead of waiting for the encoder queue to drain.

        ``lanes``: the caller is one of that many threads running batches side by side; its batch
        takes at most its share of the queue (``ceil(pending / lanes)`` jobs), so when the last
        frame groups of a video arrive together each lane encodes some of them at once instead of
        one lane taking all while the other idles (items never attend to each other in a packed
        forward; how the queue splits into batches already depends on timing)."""
        if lanes < 1:
            raise ValueError(f"run_due needs lanes >= 1, got {lanes}")
        done = 0
        for encoder in ("vision", "audio"):
            while True:
                batch = self._take(encoder, force, lanes)
                if batch:
                    done += self._run(encoder, batch)
                if not batch or not force:
                    break
        return done

    def has_pending(self) -> bool:
        """Some job waits for a forward (one may be running besides)."""
        with self._lock:
            return any(self._pending.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = dict(self._counts)
            c["pending"] = sum(len(q) for q in self._pending.values())
        c["in_flight_units"] = len(self._units)
        return c

    def check_integrity(self) -> None:
        with self._lock:
            for encoder, q in self._pending.items():
                for job in q:
                    if job.key not in self._units:
                        raise AssertionError(f"pending job {job.key[:16]} has no claim")
                    if job.turn_key not in self._turns[encoder]:
                        raise AssertionError(f"pending job {job.key[:16]} has no turn in the {encoder} queue")

    # ---- internal helpers -------------------------------------------------------------------
    def _budget(self, encoder: str) -> int:
        return self.config.vision_budget if encoder == "vision" else self.config.audio_budget

    def _take(self, encoder: str, force: bool, lanes: int = 1) -> list[EncoderJob]:
        with self._lock:
            q = self._pending[encoder]
            if not q:
                return []
            budget = self._budget(encoder)
            due = force or time.monotonic() - q[0].submitted_at >= self.config.max_wait_s
            if not due and sum(j.cost for j in q) < budget:
                return []  # wait a little for more requests' work
            share = -(-len(q) // lanes)  # ceil: this lane's part of the queue
            batch = fair_batch(q, self._turns[encoder], share, budget, self._cpu[encoder]) \
                if self.config.order == "fair" else arrival_batch(q, share, budget)
            taken = {id(j) for j in batch}
            if len(taken) == len(q):
                q.clear()
            elif all(id(q[i]) in taken for i in range(len(batch))):  # the head of the queue
                for _ in batch:
                    q.popleft()
            else:  # the queue itself stays in arrival order: its head is the oldest job, what ``due`` reads
                rest = [j for j in q if id(j) not in taken]
                q.clear()
                q.extend(rest)
            turns = self._turns[encoder]
            served = {j.turn_key for j in batch}
            turns.serve(*served)
            if len(turns) > REMEMBERED_FLOWS:  # (the flows just served stay: a video between its groups)
                turns.trim(REMEMBERED_FLOWS, {j.turn_key for j in q} | served)
            return batch

    def _run(self, encoder: str, batch: Sequence[EncoderJob]) -> int:
        """Encode a batch taken off the queue, then give back the decode budget its inputs held
        -- once, however the forward went (``_forward`` may encode units again one by one)."""
        try:
            return self._forward(encoder, batch)
        finally:
            _release(batch)

    def _forward(self, encoder: str, batch: Sequence[EncoderJob]) -> int:
        t0 = time.monotonic()
        try:
            # a media worker's tensors, read on this thread's stream (CUDA: kept from reuse until it is done)
            read_by(j.vision.rows if j.vision is not None else j.mel for j in batch)
            if encoder == "vision":
                assert self.vision is not None
                outs = self.vision.encode_items([(j.vision.rows, j.vision.grid) for j in batch])  # type: ignore[union-attr]
            else:
                outs = self._encode_audio(batch)
            if self.before_deliver is not None:
                self.before_deliver(outs)
        except Exception as exc:  # a failed forward fails its own units only, never the engine
            if len(batch) > 1:  # which unit? each alone: the others of the batch are delivered
                log.warning("a packed %s forward of %d units failed (%s); encoding them one by one",
                            encoder, len(batch), exc)
                return sum(self._forward(encoder, [job]) for job in batch)
            self._deliver(batch[0].key, None, RuntimeError(f"{encoder} encoder failed: {type(exc).__name__}: {exc}"))
            return 0
        if self.on_forward_span is not None:
            self.on_forward_span(t0, time.monotonic())
        # NaN / Inf rows would poison the request's prefill and, cached, every later request with
        # the same media: never cached, never delivered. One flag per unit, read in one sync.
        finite = torch.stack([torch.isfinite(rows).all() for rows in outs]).tolist()
        with self._lock:
            self._counts[f"forwards.{encoder}"] += 1
            for job, ok in zip(batch, finite):
                self._counts[f"encoded.{job.kind}"] += ok
        retry = []
        for job, rows, ok in zip(batch, outs, finite):
            if not ok:
                if len(batch) > 1:
                    retry.append(job)  # alone, so a neighbour in the packed forward cannot be the cause
                else:
                    self._deliver(job.key, None, _non_finite_error(encoder, job))
                continue
            if self.on_encoded is not None:
                try:
                    self.on_encoded(job.key, rows)
                except Exception:  # the cache missed a write; the units of the batch are delivered all the same
                    log.exception("storing encoder unit %s failed", job.key[:16])
            self._deliver(job.key, rows, None)
        if retry:
            log.warning("a packed %s forward of %d units gave non-finite rows for %d; encoding those one by one",
                        encoder, len(batch), len(retry))
            return len(batch) - len(retry) + sum(self._forward(encoder, [job]) for job in retry)
        return len(batch) - sum(not ok for ok in finite)

    def _encode_audio(self, batch: Sequence[EncoderJob]) -> list[torch.Tensor]:
        """Mel segments and code segments of one batch: one call (one speech-input forward)."""
        assert self.audio is not None
        mels = [j.mel for j in batch if j.mel is not None]
        codes = [j.codes for j in batch if j.codes is not None]
        if not codes:
            return self.audio.encode_segments(mels)
        mel_rows, code_rows = self.audio.encode_segments_and_codes(mels, codes)
        by_mel, by_codes = iter(mel_rows), iter(code_rows)
        return [next(by_mel) if j.mel is not None else next(by_codes) for j in batch]

    def _deliver(self, key: str, rows: torch.Tensor | None, error: BaseException | None) -> None:
        if error is not None:
            with self._lock:
                self._counts["failed_units"] += 1
        self._units.finish(key, rows, error)


def _on_cpu(module: torch.nn.Module | None) -> bool:
    """Does ``module`` (an encoder, or None) compute on the CPU? (one without parameters: yes)"""
    params = getattr(module, "parameters", None)
    param = None if params is None else next(params(), None)
    return param is None or param.device.type == "cpu"


def _release(jobs: Sequence[EncoderJob]) -> None:
    """The batcher is done with ``jobs``: their inputs' bytes go back to the decode budget."""
    for job in jobs:
        if job.release is not None:
            try:
                job.release()
            except Exception:  # a release that fails must not lose the others' (nor the rows' delivery)
                log.exception("releasing the decode budget of unit %s failed", job.key[:16])


def _non_finite_error(encoder: str, job: EncoderJob) -> Exception:
    """The error of a unit whose rows came out NaN / Inf: the media's fault (HTTP 400) when its
    input already was not finite (a float stream decode let through, samples so loud the log-mel
    overflows), an encoder failure otherwise (an overflow inside the model)."""
    data = job.vision.rows if job.vision is not None else job.mel if job.mel is not None else job.codes
    if data is not None and data.is_floating_point() and not bool(torch.isfinite(data).all()):
        what = "patch rows" if job.vision is not None else "log-mel"
        return UndecodableMediaError(f"{job.kind} input holds non-finite values (NaN or Inf) in its {what}, "
                                     f"so its {encoder} encoding is not finite; send finite media")
    return RuntimeError(f"{encoder} encoder failed: its output for a {job.kind} unit is not finite (NaN or Inf)")
