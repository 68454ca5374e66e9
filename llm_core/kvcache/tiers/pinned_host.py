"""Page-locked host memory of exactly the size asked for, for the host KV tier's row tensors.

``torch.zeros(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every
allocation up to the next power of two (torch 2.11, ``CachingHostAllocator::allocate``): a 40 GB
host KV budget would lock 64 GB of RAM, and a 70 GB one 128 GB -- more than many hosts have (vLLM's
``--cpu-offload-gb`` has the same surplus). So a large, long-lived buffer is allocated pageable and
registered with the CUDA driver instead (``cudaHostRegister``, as torch's own checkpoint staging
does): page-locked, so copies to and from the GPU are asynchronous DMA, at its exact size.

The registration lives as long as the buffer object: it is undone when the object is collected
(before its memory can be freed: the finalizer holds the tensor until it has unregistered it). Only
the host KV pool, which lives as long as its engine, holds one.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


class PinnedHostBuffer:
    """A zeroed ``[rows, cols]`` host tensor (``tensor``), page-locked at its exact size for the CUDA
    device ``pin_for`` (None: left pageable); ``pinned`` says whether it is.

    A refused registration raises (with what to lower) rather than falling back: the refusal
    stays as the CUDA runtime's last error on this thread, which torch's next kernel-launch check
    would report as an unrelated failure."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, *, pin_for: torch.device | None) -> None:
        self.tensor = torch.zeros(rows, cols, dtype=dtype)
        self.pinned = False
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if pin_for is None or pin_for.type != "cuda" or not nbytes or not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        # on the pool's device: with cuda:0 current, the call would open a context on GPU 0
        with torch.cuda.device(pin_for):
            err = int(cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, _REGISTER_PORTABLE))
        if err != 0:
            raise RuntimeError(f"could not page-lock {nbytes} bytes of host memory for the host KV tier "
                               f"(cudaError {err}): lower kv_host_bytes")
        self.pinned = True
        # holds the tensor: its memory cannot be freed before the unregister ran
        finalizer = weakref.finalize(self, _unregister, cudart, self.tensor)
        finalizer.atexit = False  # the process's exit releases both; the driver may be gone by then

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _unregister(cudart, tensor: torch.Tensor) -> None:
    err = int(cudart.cudaHostUnregister(tensor.data_ptr()))
    if err != 0:
        log.warning("cudaHostUnregister of the host KV memory failed (cudaError %d)", err)
