"""CUDA streams of the threads that hand a media unit's device tensors to one another.

Three threads touch them, each on its own stream:

    media worker    copy, resize, normalise -> patch rows / log-mel;   the preprocessing side stream
                    rows read back from the encoder cache's tiers
    encoder         forward -> embedding rows                          the encoder worker's stream
                                                                       (inline: the engine thread's)
    engine thread   prefill reads the rows                             the device's default stream

Two rules keep the hand-offs correct without making the streams wait for one another:

1. **Values.** A producer's kernels are finished before it hands its tensors over: a media worker
   waits for its work on the side stream (only that thread waits; :meth:`SideStream.finished`), the
   encoder worker for its stream (``EncoderWorker.deliver_ready``). PyTorch's non-default streams
   do not wait for the default stream, so without this the encoder could read patch rows whose
   normalisation is still queued. A side stream, not the default one: there the preprocessing (or a
   cached unit's copy to the device) would queue behind the LLM step running on it, and waiting for
   it would wait for that step.
2. **Memory.** The caching allocator hands a freed block back to the stream it was allocated on at
   once. When another stream still has kernels queued that read it (an inline encoder forward on the
   default stream reading a worker's patch rows; a prefill step reading embedding rows while their
   request is aborted), the block could be rewritten under them. :func:`read_by` records the reading
   stream on the tensor (``Tensor.record_stream``): the allocator then waits for the work that
   stream had queued when the tensor was freed.

On CPU every function here does nothing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch


class SideStream:
    """One high-priority CUDA side stream on one device, shared by the threads that run work on it
    for other streams to read; each thread waits for its own work only."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"device": self.device}  # a stream belongs to this process

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["device"])

    @contextmanager
    def finished(self) -> Iterator[None]:
        """Run the body's device work on the side stream; on a normal exit, return once that work
        is done (the tensors it made are complete for any stream). CPU: just the body.

        One stream for every thread, not one each: the caching allocator keeps a stream's freed
        blocks for that stream, so a stream per media thread would keep each thread's video
        buffers from every other one. High priority: the preprocessing is short and a first token
        waits for it; it also keeps the stream out of torch's pool of normal-priority streams,
        which hands the same few streams out in turn (the encoder's, a graph capture's)."""
        if self.device.type != "cuda":
            yield
            return
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device, priority=-1)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            yield
            done.record()
        done.synchronize()  # this thread's work (and what other threads queued before it), not later work


def read_by(tensors: Iterable[torch.Tensor | None], stream: torch.cuda.Stream | None = None) -> None:
    """``stream`` (default: the current stream of each tensor's device) reads these tensors: their
    blocks are not reused until the work it has queued when they are freed is done. CPU tensors and
    None are skipped."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream if stream is not None else torch.cuda.current_stream(t.device))
