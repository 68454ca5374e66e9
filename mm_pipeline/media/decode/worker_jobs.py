"""What runs inside a decode worker process (backend.py's ProcessDecodeBackend), and the
shared-memory blocks both sides use: the parent shares an item's bytes in one block, a job decodes
and publishes its frames in a block of its own name, the parent takes (copies and unlinks) it.

The jobs check what they are about to allocate themselves, before any pixel is decoded, so a
worker holds to the same limits as the parent."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from mm_pipeline.errors import MediaTooLarge
from mm_pipeline.media.decode.budget import DecodeControl
from mm_pipeline.media.decode.image import decode_image
from mm_pipeline.media.decode.video_chunks import decode_chunk
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.types import MediaItem


def fixed_target(target: tuple[int, int]) -> Callable[[int, int], tuple[int, int]]:
    # decode_image asks for the target of the oriented (h, w) the caller probed already
    return lambda _h, _w: target


def take_block(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The receiver's side: copy block ``name`` into a tensor of ``shape`` uint8, then unlink it."""
    out = torch.empty(shape, dtype=torch.uint8)
    if out.numel() == 0:
        return out
    block = shared_memory.SharedMemory(name=name)
    try:
        view = np.ndarray(shape, dtype=np.uint8, buffer=block.buf)
        out.numpy()[...] = view
        del view
    finally:
        block.close()
        block.unlink()
    return out


def unlink_block(name: str) -> None:
    try:
        block = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return  # taken by the receiver, or never created
    block.close()
    block.unlink()


# ---- worker process side ----------------------------------------------------------------------
_board: shared_memory.SharedMemory | None = None


def init_worker(board_name: str) -> None:
    global _board
    torch.set_num_threads(1)  # the pool's processes are the parallelism
    _board = shared_memory.SharedMemory(name=board_name)


def noop() -> None:
    return None


def worker_control(slot: int, timeout_s: float | None, what: str) -> DecodeControl | None:
    if timeout_s is None and slot < 0:
        return None
    board = _board
    wanted = None if slot < 0 or board is None else (lambda: board.buf[slot] == 0)
    return DecodeControl(timeout_s if timeout_s is not None else float("inf"), wanted, what=what)


_last_input: tuple[str, bytes] = ("", b"")  # the chunks of one video often come in a row


def worker_input(source: tuple[str, int], item: MediaItem) -> MediaItem:
    global _last_input
    name, size = source
    if _last_input[0] != name:
        block = shared_memory.SharedMemory(name=name)
        try:
            _last_input = (name, bytes(block.buf[:size]))
        finally:
            block.close()
    return dataclasses.replace(item, data=_last_input[1])


def chunk_job(name: str, slot: int, timeout_s: float | None, source: tuple[str, int], item: MediaItem,
               info: Any, indices: list[int],
               groups: list[int], tp: int, limits: MediaLimits, size: tuple[int, int], threads: int
               ) -> tuple[int, ...]:
    # the worker checks what it is about to allocate itself, before any pixel is decoded
    h, w = size
    frames = len(groups) * tp
    if info is not None and info.width * info.height > limits.max_pixels:
        raise MediaTooLarge(f"video frames are {info.width}x{info.height}, limit {limits.max_pixels} pixels")
    if h * w > limits.max_pixels or frames > limits.max_frames:
        raise MediaTooLarge(f"a video chunk of {frames} frames of {w}x{h} is over the limits")
    if frames * h * w * 3 > limits.max_decoded_bytes_in_flight:
        raise MediaTooLarge(f"a video chunk of {frames} frames of {w}x{h} is over max_decoded_bytes_in_flight")
    control = worker_control(slot, timeout_s, f"a video chunk from {item.origin}")
    item = worker_input(source, item)
    return publish(name, decode_chunk(item, info, indices, groups, tp, limits, size, control, threads=threads))


def image_job(name: str, slot: int, timeout_s: float | None, source: tuple[str, int], item: MediaItem,
               limits: MediaLimits, target: tuple[int, int] | None) -> tuple[int, ...]:
    # decode_image enforces max_pixels on the header before decoding
    image = decode_image(worker_input(source, item), limits, target=None if target is None else fixed_target(target))
    return publish(name, image.pixels)


def publish(name: str, frames: torch.Tensor) -> tuple[int, ...]:
    """Copy ``frames`` into a new block ``name`` (the parent unlinks it); return the shape."""
    array = frames.numpy()
    if array.nbytes == 0:
        return tuple(array.shape)
    block = shared_memory.SharedMemory(name=name, create=True, size=array.nbytes)
    try:
        np.ndarray(array.shape, dtype=np.uint8, buffer=block.buf)[...] = array
    finally:
        block.close()
    return tuple(array.shape)
