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

What a decode hands on stays counted: the float32 patch rows (or log-mels) it made wait in the
encoder queue, so the block moves their bytes out of its reservation into a ``Hold``
(``Reservation.hand_on``: no waiting, the total unchanged) that the encoder batcher releases once
it is done with the unit (encoded, failed or dropped). While the encoder is slower than the
decoders, new decodes wait for those bytes instead of piling rows up beside the budget:

    worker:  reserve(peak) ─► decode ─► rows ─► hand_on(rows' bytes) ─► block ends: the rest released
    encoder:                                     queue ─► forward ─► Hold.release

Early decodes (decoding while the bytes arrive, ``media.decode.early``) hold what they keep through
``take_early``/``release_early`` instead: they grow piece by piece and must never wait (a full
budget only means they stop keeping and the item is decoded after arrival), and together they
hold at most half the budget -- what they keep is released only once production takes it, and
production's own reservations must still find room meanwhile. A video's idle open containers
(``video_chunks.VideoContainers``: their decoders' frames) take from the same share
(``take_idle``), and are closed when it has no room. Idle bytes are a cache nobody uses, so a
reservation that must wait first has every registered idle holder (``add_idle_holder``) let go of
them, and nothing new is kept idle while it waits. Before, an idle container gave its bytes back
only when a chunk borrowed it -- and a chunk reserves before it borrows: a chunk that fitted the
budget but not beside its own video's idle container waited out its deadline.

    reserve(n) ─ room? ─no─► idle holders release (outside the lock) ─ room? ─no─► wait, and again

A worker thread waiting here is ``worker_pool.blocked()``: it uses no CPU, so it leaves its core
to the encoder (whose progress is what frees the bytes).

Every estimate comes from headers, so a decoded frame is checked against its header's size
(``check_frame_size``) and kept frames are charged their own planes (``frame_nbytes``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import av

from mm_pipeline.errors import MediaError, MediaTooLarge
from mm_pipeline.media.worker_pool import blocked


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


class Hold:
    """Bytes of a ``DecodeBudget`` that outlive the ``reserve`` block that took them: decoded data
    handed on (a unit's patch rows waiting in the encoder queue), counted until ``release``.
    Releasing again does nothing, so every path that drops the data may release it."""

    def __init__(self, budget: DecodeBudget, nbytes: int) -> None:
        self.nbytes = nbytes
        self._budget = budget
        self._released = False

    def release(self) -> None:
        self._budget._give_back(self)

    def parts(self, n: int) -> list[Callable[[], None]]:
        """``n`` release functions for ``n`` holders of these bytes (the frame groups of one chunk
        are views of one tensor: its memory goes only with the last of them): each counts once
        however often it is called, and the last one releases the hold."""
        lock, left = threading.Lock(), [n]

        def part() -> Callable[[], None]:
            done = [False]

            def release() -> None:
                with lock:
                    if done[0]:
                        return
                    done[0] = True
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    self.release()
            return release
        return [part() for _ in range(n)]


class Reservation:
    """What one ``reserve`` block holds; ``hand_on`` moves part of it past the block."""

    def __init__(self, budget: DecodeBudget, nbytes: int) -> None:
        self.nbytes = nbytes  # still held by the block (released when it ends)
        self._budget = budget
        self._ended = False

    def hand_on(self, nbytes: int) -> Hold:
        """Move ``nbytes`` of this reservation into a ``Hold`` that stays counted after the block
        ends -- at most what the block still holds (its estimate covered the data handed on), so
        the budget's total does not change and nothing waits."""
        with self._budget._cond:
            if self._ended:
                raise RuntimeError("hand_on after the reserve block ended: its bytes were released")
            n = min(max(0, int(nbytes)), self.nbytes)
            self.nbytes -= n
        return Hold(self._budget, n)


class IdleHolder(Protocol):
    """Something that keeps budget bytes for data nobody uses now (a cache) and can drop it."""

    def release_idle(self) -> None:
        """Drop what is idle and give its bytes back (``release_early``)."""
        ...


class DecodeBudget:
    """Bytes of decoded media held by all decodes in flight, at most ``capacity``.

    Invariant (under ``_cond``): ``0 <= _early <= _used <= capacity`` and ``_early <= early_capacity``;
    every ``reserve`` releases what it took and did not hand on; every ``Hold`` is released once."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"DecodeBudget capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.early_capacity = capacity // 2  # early decodes together (module doc)
        self._used = 0
        self._early = 0
        self._waiting = 0  # reservations waiting for room now
        # idle holders, weakly: one its owner forgot to remove holds nothing once it is gone
        self._idle_holders: weakref.WeakSet[IdleHolder] = weakref.WeakSet()
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._used

    @property
    def early_in_use(self) -> int:
        with self._cond:
            return self._early

    @property
    def waiting(self) -> int:
        """Reservations waiting for room now."""
        with self._cond:
            return self._waiting

    def add_idle_holder(self, holder: IdleHolder) -> None:
        """A waiting reservation asks ``holder`` to release what it keeps idle (module doc)."""
        with self._cond:
            self._idle_holders.add(holder)

    def remove_idle_holder(self, holder: IdleHolder) -> None:
        with self._cond:
            self._idle_holders.discard(holder)

    def take_idle(self, nbytes: int) -> bool:
        """``take_early`` for bytes kept idle (a cache), refused while a reservation waits: they
        would only be taken back from the holder at once. Given back with ``release_early``."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            return not self._waiting and self._take_early(nbytes)

    def take_early(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more for an early decode if there is room now (never waits)."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            return self._take_early(nbytes)

    def _take_early(self, nbytes: int) -> bool:
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
    def reserve(self, nbytes: int, control: DecodeControl | None = None, what: str = "media"
                ) -> Iterator[Reservation]:
        """Hold ``nbytes`` for the block; wait for room until ``control``'s deadline (then 413).
        The block may hand part of it on (``Reservation.hand_on``); the rest is released at its end."""
        nbytes = max(0, int(nbytes))
        if nbytes > self.capacity:
            raise MediaTooLarge(f"{what} needs about {_mib(nbytes)} of decoded pixels or samples, over the "
                                f"server's {_mib(self.capacity)} budget (max_decoded_bytes_in_flight)")
        with self._cond:
            room = self._used + nbytes <= self.capacity
            if room:
                self._used += nbytes
        if not room:
            self._wait_and_take(nbytes, control)
        reservation = Reservation(self, nbytes)
        try:
            yield reservation
        finally:
            with self._cond:
                reservation._ended = True
                self._used -= reservation.nbytes
                self._cond.notify_all()

    def _wait_and_take(self, nbytes: int, control: DecodeControl | None) -> None:
        """Take ``nbytes`` once there is room: idle holders release first, then wait for releases
        (until ``control``'s deadline). The worker thread is ``blocked()`` meanwhile."""
        with blocked():
            with self._cond:
                self._waiting += 1  # from here no new bytes are kept idle (take_idle)
            try:
                while True:
                    self._reclaim_idle()
                    with self._cond:
                        if self._used + nbytes <= self.capacity:
                            self._used += nbytes
                            return
                        wait = None if control is None else control.remaining_s
                        if control is not None and wait is not None and wait <= 0:
                            control.check()  # raises the timeout
                        self._cond.wait(timeout=0.05 if wait is None else min(wait, 0.05))
                    if control is not None:
                        control.check()  # cancelled or past the deadline while waiting
            finally:
                with self._cond:
                    self._waiting -= 1

    def _reclaim_idle(self) -> None:
        # outside ``_cond``: a holder takes its own lock, then the budget's (VideoContainers.lend)
        with self._cond:
            holders = list(self._idle_holders)
        for holder in holders:
            holder.release_idle()

    def _give_back(self, hold: Hold) -> None:
        with self._cond:
            if hold._released:
                return
            hold._released = True
            self._used -= hold.nbytes
            self._cond.notify_all()

    def check_integrity(self) -> None:
        with self._cond:
            if not 0 <= self._used <= self.capacity:
                raise AssertionError(f"decode budget in use {self._used} outside [0, {self.capacity}]")
            if not 0 <= self._early <= min(self._used, self.early_capacity):
                raise AssertionError(f"early decodes hold {self._early} of {self._used} in use "
                                     f"(their cap {self.early_capacity})")
            if self._waiting < 0:
                raise AssertionError(f"{self._waiting} reservations waiting")


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
