"""Page-locked host memory of exactly the size asked for, for the host KV tier's row tensors.

``torch.zeros(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every
allocation up to the next power of two (torch 2.11, ``CachingHostAllocator::allocate``): a 40 GB
host KV budget would lock 64 GB of RAM, and a 70 GB one 128 GB -- more than many hosts have (vLLM's
``--cpu-offload-gb`` has the same surplus). So a large, long-lived buffer is allocated pageable and
registered with the CUDA driver instead (``cudaHostRegister``, as torch's own checkpoint staging
does): page-locked, so copies to and from the GPU are asynchronous DMA, at its exact size.

The registration lives as long as the buffer object: it is undone when the object is collected
(before its memory can be freed: the finalizer holds the tensor until it has unregistered it).
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


class PinnedHostBuffer:
    """A zeroed ``[rows, cols]`` host tensor (``tensor``), page-locked at its exact size when ``pin``
    (and CUDA is there); ``pinned`` says whether the registration took. A failed registration
    (the driver's locked-memory limit, say) leaves the tensor pageable with a warning: copies then
    go through a staging buffer, slower but the same bytes."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, *, pin: bool) -> None:
        self.tensor = torch.zeros(rows, cols, dtype=dtype)
        self.pinned = False
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if not (pin and nbytes and torch.cuda.is_available()):
            return
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, _REGISTER_PORTABLE))
        if err != 0:
            log.warning("could not page-lock %d bytes of host KV memory (cudaError %d); the host tier's "
                        "copies stay synchronous", nbytes, err)
            return
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
