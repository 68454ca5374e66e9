"""Host buffers on transparent huge pages (2 MB) for the weights and KV pages a CPU decode step streams.

Why: a batch-32 decode step of the text model reads ~60 MB of weights and ~17 MB of K/V, far past
the L3, so every step streams them from memory. On 4 KB pages that is ~19k TLB entries a step
(the L2 TLB holds a few thousand): the C kernels' loads and prefetches wait on page walks as
well as on memory. Linux backs an anonymous mapping with 2 MB pages when it is advised
``MADV_HUGEPAGE`` before its first touch (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise`` or ``always``); memory already touched stays on 4 KB pages, so the weights are copied
into a fresh advised mapping rather than advised in place. Only where the bytes live changes:
values, shapes and strides stay, so every kernel computes the same bits.

Where the kernel gives no huge pages (THP ``never``, no ``madvise``, fragmentation) the buffers are
plain anonymous memory: nothing else changes.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: each tensor's bytes start where torch's own allocator would put them
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ARENAS: set[int] = set()  # start addresses of move_module_'s arenas (a repeated move is skipped)


def supported() -> bool:
    """Whether this host can give advised anonymous memory huge pages (Linux, THP not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 on a fresh anonymous mapping advised ``MADV_HUGEPAGE`` and not touched yet
    (the first write faults huge pages in). The tensor keeps the mapping alive."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages: the tail is not left on 4 KB pages
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if supported():
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero-filled contiguous CPU tensors of ``shapes``, carved from one huge-page-advised arena
    (one arena: each tensor's last huge page is not a separate, mostly empty 2 MB). Touched now,
    so resident from the start, as ``torch.zeros`` is."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * item for shape in shapes]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // _ALIGN) * _ALIGN)
    arena = empty(starts[-1])
    return [arena[a:a + n].view(dtype).view(shape).zero_() for a, n, shape in zip(starts, sizes, shapes)]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (views and transposes included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def move_module_(module: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer of ``module`` into one huge-page-advised arena, keeping
    each tensor's shape, strides and values and the sharing between tensors (a tied LM head stays
    tied). Returns the bytes moved; 0 when there is nothing on the CPU, huge pages are not
    supported, or everything already lives in an arena of this function's (idempotent)."""
    slots = [(mod._parameters, name) for mod in module.modules() for name, p in mod._parameters.items()
             if p is not None and p.device.type == "cpu"]
    slots += [(mod._buffers, name) for mod in module.modules() for name, b in mod._buffers.items()
              if b is not None and b.device.type == "cpu"]
    if not slots or not supported():
        return 0
    offsets: dict[int, int] = {}  # storage address -> byte offset in the arena
    total = 0
    for d, name in slots:
        storage = d[name].untyped_storage()
        if storage.data_ptr() not in offsets:
            offsets[storage.data_ptr()] = total
            total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    if all(ptr in _ARENAS for ptr in offsets):
        return 0  # moved before (a second engine over the same model)
    arena = empty(total)
    _ARENAS.add(arena.data_ptr())
    copied: set[int] = set()
    moved: dict[int, torch.Tensor] = {}  # id of the tensor -> its copy (a tied Parameter sits in two modules)
    for d, name in slots:
        t = d[name]
        if id(t) not in moved:
            ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            off = offsets[ptr]
            if ptr not in copied:
                arena[off:off + nbytes].copy_(_storage_bytes(t))
                copied.add(ptr)
            item = t.element_size()
            typed = arena[off:off + nbytes // item * item].view(t.dtype)
            # as_strided's offset counts from the arena's start, in elements
            moved[id(t)] = typed.as_strided(t.size(), t.stride(), off // item + t.storage_offset())
    for d, name in slots:
        t = d[name]
        if isinstance(t, torch.nn.Parameter):
            t.data = moved[id(t)]  # the same Parameter object: optimisers, hooks and tying see the move
        else:
            d[name] = moved[id(t)]
    return total
