"""Open PyAV containers of one video, lent to its chunk decodes and closed together.

A streamed video is decoded in chunks (video_chunks), each from its own seek point, and each chunk
used to open the file again. Opening an H.264 MP4 runs FFmpeg's stream probe, which decodes frames
until it has guessed the stream's reorder delay: ~10 ms of CPU per open at 720p (an MPEG-4 part 2
file: 0.4 ms). A 60 s clip cut into 30 one-group chunks paid 0.3 s of its ~1 s of decode CPU on
opens. Here a chunk borrows a container another chunk of the same video has finished with; the
decoder seeks (which flushes it) before its first frame, so the frames are those of a fresh open.

    chunk 0 ─ open ─ decode ─ return ┐           chunk 2 ─ borrow ─ seek ─ decode ─ return
    chunk 1 ─ open ─ decode ─ return ┴─ free: [c0, c1] ─────┘          ...  close() at the end

At most as many containers are open as chunks decode at once (the decode workers). An idle one
holds its decoder's frames, so it is kept only while the decode budget's non-waiting share has room
for them (``DecodeBudget.take_early``, the share early decodes use): a server decoding many videos
at once closes containers as before rather than hold decoder memory outside the budget. The owner
(the video's production) calls ``close`` when the video is done, whatever happened; a container
lent at that moment is closed when it comes back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import av

from mm_pipeline.media.decode.budget import DecodeBudget
from mm_pipeline.media.sniff import open_av
from mm_pipeline.media.types import MediaItem


class VideoContainers:
    """Containers of ``item`` for ``decode_range``; every borrower must use one codec-thread
    setting (it is fixed when a container's decoder opens). ``budget``/``idle_bytes``: an idle
    container holds ``idle_bytes`` of ``budget`` (its decoder's frames) or is closed."""

    def __init__(self, item: MediaItem, budget: DecodeBudget | None = None, idle_bytes: int = 0) -> None:
        self.item = item
        self.budget = budget
        self.idle_bytes = idle_bytes
        self.opened = 0  # containers opened so far (the counter video_containers_opened)
        self._free: list[av.container.InputContainer] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def lend(self) -> Iterator[tuple[av.container.InputContainer, bool]]:
        """``(container, fresh)``: fresh is True when just opened (not positioned by an earlier
        decode). A decode that raised closes its container rather than handing it on."""
        with self._lock:  # (after close: a container of its own, closed after, as without this)
            container = self._free.pop() if self._free else None
        if container is not None and self.budget is not None:
            self.budget.release_early(self.idle_bytes)
        fresh = container is None
        if container is None:
            container = open_av(self.item.data)
            with self._lock:
                self.opened += 1
        done = False
        try:
            yield container, fresh
            done = True
        finally:
            with self._lock:
                keep = done and not self._closed and (self.budget is None or self.budget.take_early(self.idle_bytes))
                if keep:
                    self._free.append(container)
            if not keep:
                container.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for container in free:
            container.close()
            if self.budget is not None:
                self.budget.release_early(self.idle_bytes)
