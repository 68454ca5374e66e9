"""Bounds on decode work: a per-item deadline and cancellation (``DecodeControl``), and the bytes of
decoded media in flight across the server (``DecodeBudget``).

Decoders run on worker threads, where asyncio cannot interrupt them; they call
``control.check()`` once per frame (or audio packet) instead, so a decode stops at the next frame
when its deadline passes or when nobody wants its result any more:

    worker thread:   reserve(bytes) ─► frame ─ check ─► frame ─ check ─► ... ─► release
                                                   └─ deadline passed / cancelled ─► MediaError

Every decode reserves its estimated peak bytes (from headers, before any pixel is decoded) in the
one ``DecodeBudget`` of the runtime; a reservation waits (up to the item's deadline) until the
bytes of other decodes are released, so N concurrent decodes never hold more than the budget.

Early decodes (decoding while the bytes arrive, ``media.decode.early``) hold what they keep through
``take_early``/``release_early`` instead: they grow piece by piece and must never wait (a full
budget only means they stop keeping and the item is decoded after arrival), and together they
hold at most half the budget -- what they keep is released only once production takes it, and
production's own reservations must still find room meanwhile. A video's idle open containers
(``video_chunks.VideoContainers``: their decoders' frames) take from the same share, and are
closed when it has no room.

Every estimate comes from headers, so a decoded frame is checked against its header's size
(``check_frame_size``) and kept frames are charged their own planes (``frame_nbytes``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import av

from mm_pipeline.errors import MediaError, MediaTooLarge


class MediaDecodeTimeout(MediaTooLarge):
    """A decode ran past its deadline: the item costs more than this server spends on one (413)."""


class DecodeCancelled(MediaError):
    """Nobody wants the decode's result any more (the request ended)."""


class DecodeControl:
    """Deadline and cancellation of one item's decode; ``check`` is cheap enough per frame.

    ``wanted``: asked at most every ``poll_s`` seconds; False cancels (e.g. no request still
    waits for the units a chunk decodes)."""

    def __init__(self, timeout_s: float, wanted: Callable[[], bool] | None = None, poll_s: float = 0.05,
                 what: str = "media") -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.what = what
        self._wanted = wanted
        self._poll_s = poll_s
        self._next_poll = 0.0
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise if the decode must stop now."""
        now = time.monotonic()
        if self._cancelled.is_set():
            raise DecodeCancelled(f"decoding {self.what} was cancelled (the request ended)")
        if now > self.deadline:
            raise MediaDecodeTimeout(f"decoding {self.what} took over {self.timeout_s:g} s "
                                     f"(decode_timeout_s); send a smaller or shorter item")
        if self._wanted is not None and now >= self._next_poll:
            self._next_poll = now + self._poll_s
            if not self._wanted():
                self._cancelled.set()
                raise DecodeCancelled(f"decoding {self.what} was cancelled (no request wants it)")


def check(control: DecodeControl | None) -> None:
    """``control.check()`` when there is a control (decoders take ``control=None`` in tests)."""
    if control is not None:
        control.check()


class DecodeBudget:
    """Bytes of decoded media held by all decodes in flight, at most ``capacity``.

    Invariant (under ``_cond``): ``0 <= _early <= _used <= capacity`` and ``_early <= early_capacity``;
    every ``reserve`` releases what it took."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"DecodeBudget capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.early_capacity = capacity // 2  # early decodes together (module doc)
        self._used = 0
        self._early = 0
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._used

    @property
    def early_in_use(self) -> int:
        with self._cond:
            return self._early

    def take_early(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more for an early decode if there is room now (never waits)."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            if self._used + nbytes > self.capacity or self._early + nbytes > self.early_capacity:
                return False
            self._used += nbytes
            self._early += nbytes
            return True

    def release_early(self, nbytes: int) -> None:
        """Give back ``nbytes`` an early decode took (the caller tracks what it holds)."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            if nbytes > self._early:
                raise ValueError(f"release_early({nbytes}) but early decodes hold {self._early}")
            self._used -= nbytes
            self._early -= nbytes
            self._cond.notify_all()

    @contextlib.contextmanager
    def reserve(self, nbytes: int, control: DecodeControl | None = None, what: str = "media") -> Iterator[None]:
        """Hold ``nbytes`` for the block; wait for room until ``control``'s deadline (then 413)."""
        nbytes = max(0, int(nbytes))
        if nbytes > self.capacity:
            raise MediaTooLarge(f"{what} needs about {_mib(nbytes)} of decoded pixels or samples, over the "
                                f"server's {_mib(self.capacity)} budget (max_decoded_bytes_in_flight)")
        with self._cond:
            while self._used + nbytes > self.capacity:
                wait = None if control is None else control.remaining_s
                if wait is not None and wait <= 0:
                    control.check()  # raises the timeout
                self._cond.wait(timeout=0.05 if wait is None else min(wait, 0.05))
                if control is not None:
                    control.check()  # cancelled or past the deadline while waiting
            self._used += nbytes
        try:
            yield
        finally:
            with self._cond:
                self._used -= nbytes
                self._cond.notify_all()

    def check_integrity(self) -> None:
        with self._cond:
            if not 0 <= self._used <= self.capacity:
                raise AssertionError(f"decode budget in use {self._used} outside [0, {self.capacity}]")
            if not 0 <= self._early <= min(self._used, self.early_capacity):
                raise AssertionError(f"early decodes hold {self._early} of {self._used} in use "
                                     f"(their cap {self.early_capacity})")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"


def check_frame_size(frame: av.VideoFrame, width: int, height: int, what: str) -> None:
    """Refuse a frame with more pixels than its stream's header declares (``width`` x ``height``).
    The header is all that is known before decoding: the pixel limit is checked on it and the
    decode budget reserved from it, and VP8/VP9 keyframes or an in-band H.264 SPS may change the
    size mid-stream -- a 0.5 MB file declaring 64x64 can switch to 4096x4096 frames, and its
    decoder would hold thousands of times what was counted. (A header without a size, 0 x 0, was
    counted as nothing either way: it bounds nothing here.)"""
    declared = width * height
    if declared and frame.width * frame.height > declared:
        raise MediaTooLarge(f"{what}: frames grow mid-stream from {width}x{height} (its header) to "
                            f"{frame.width}x{frame.height}; re-encode it at one size")


def frame_nbytes(frame: av.VideoFrame) -> int:
    """Bytes a decoded frame holds: its planes as decoded (a 10-bit 4:4:4 frame is 4x an 8-bit 4:2:0 one)."""
    return sum(p.buffer_size for p in frame.planes)
