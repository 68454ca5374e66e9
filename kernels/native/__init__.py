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


def build_all() -> dict[str, bool]:
    """Build (or load from the cache) every kernel now, whether each is available. An engine calls it
    at start so its first decode step does not pay the compile (1-2 s on a fresh machine)."""
    import torch

    from kernels.native import decoder_layer, fused_layer, greedy_head, moe_experts, mtp_draft, paged_decode

    return {"fused_layer": fused_layer.available(), "decoder_layer": decoder_layer.available(), "greedy_head": greedy_head.available(),
            "moe_experts": moe_experts.available(),
            "mtp_draft": mtp_draft.available(), "paged_decode": paged_decode.available(torch.float32, torch.device("cpu"))}


__all__ = ["build_all", "enabled", "library", "set_enabled"]
