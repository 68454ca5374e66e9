"""C kernels for CPU decode steps, compiled on first use for the host CPU and called through ctypes.

Why C and not more torch: a CPU decode step at batch 8-32 is weight streaming plus dispatch (README,
"Where a text step's time goes"). MKL's GEMMs stream a skinny operand at a fraction of the memory
bandwidth, and the paged attention needs a gather and a flash call per step part. A few hundred lines
of plain C, one call per layer, read the weights and the KV pages in place: no gather copies, a few
dispatches per layer instead of dozens (how close to memory speed each kernel gets: README, "Native
CPU kernels").

Plain C (no torch headers) compiles in about a second with the system compiler, so a fresh machine
pays nothing noticeable on the first step; :func:`library` caches the shared object per source, compiler
and CPU (``-march=native``). Without a compiler, or with ``native_cpu_kernels`` off (engine config;
``MMSERVE_NATIVE_KERNELS=0`` in the environment), :func:`library` returns None and every caller keeps
its torch path, which is also what the tests compare the C kernels to.
"""

from kernels.native.build import enabled, library, set_enabled

__all__ = ["enabled", "library", "set_enabled"]
