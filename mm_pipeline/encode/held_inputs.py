"""Decoded inputs kept counted in the decode budget until their encoder job is done: a production's
releases by unit index (:class:`HeldInputs`) and the hand-over out of a decode's reservation.

Inputs decoded at planning (an audio clip's log-mels, a video's sound: the cold path) wait in their
plan until a production submits them -- or for ever short of it: a request may drop its plans
unproduced (over a request budget, another item failing, the client leaving), and no owner's end
says so. Their holds (``HeldInputs(until_dropped=True)``) are also released when the tensors go,
whichever comes first: their job's release after the forward, or the last reference to them
dropped."""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Iterable

import torch

from mm_pipeline.media.decode.budget import Reservation


class HeldInputs:
    """Budget releases of one production's decoded inputs by unit index, from the worker that
    decoded an input until ``take`` hands its release to the unit's encoder job; ``close`` (the
    production ended) releases what no job took, and from then on ``put`` releases at once (a
    chunk still decoding on a worker after a failure). ``until_dropped``: each input's release also
    runs when its tensor is dropped (module doc; for a plan's inputs, which no ``close`` ends)."""

    def __init__(self, until_dropped: bool = False) -> None:
        self.until_dropped = until_dropped
        self._lock = threading.Lock()
        self._by_unit: dict[int, Callable[[], None]] = {}
        self._closed = False

    def put(self, i: int, release: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                drop: Callable[[], None] | None = release
            else:  # (a unit is decoded once per production; a second put replaces the first)
                drop = self._by_unit.get(i)
                self._by_unit[i] = release
        if drop is not None:
            drop()

    def take(self, i: int) -> Callable[[], None] | None:
        with self._lock:
            return self._by_unit.pop(i, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left, self._by_unit = list(self._by_unit.values()), {}
        for release in left:
            release()


def hand_on(reservation: Reservation, inputs: Iterable[tuple[int, torch.Tensor]], held: HeldInputs) -> None:
    """Keep the bytes of decoded inputs (unit index, tensor) counted in the budget after their
    decode's block ends: moved out of ``reservation`` into ``held``, one release per unit. Inputs
    that are views of one tensor (a chunk's frame groups, a clip's mel segments) share its memory,
    freed only with the last of them: one hold of its storage, split among them (with
    ``held.until_dropped``, each view's part also released when that view is dropped: the storage
    goes with the last view, and so do the bytes)."""
    by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, t in inputs:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((i, t))
    for views in by_storage.values():
        hold = reservation.hand_on(views[0][1].untyped_storage().nbytes())
        for (i, t), release in zip(views, hold.parts(len(views))):
            held.put(i, release)
            if held.until_dropped:
                weakref.finalize(t, release)  # (a part counts once: the job's release may come first)
