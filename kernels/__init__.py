"""Attention, MoE and KV-copy kernels: Triton on CUDA, CPU implementations on CPU, torch references
beside both.

Callers use the dispatch functions in :mod:`kernels.ops`. CUDA tensors take the Triton kernels; CPU
tensors take the CPU paths (:mod:`kernels.cpu.paged_attention`: flash-style attention over pages with an
exact sink correction; :mod:`kernels.cpu.moe`: grouped expert matmuls) or, for the small copy and band
ops, the torch reference itself. Each plain reference (``*_ref``) lives next to its kernel and is
what the tests compare both fast paths to; it is not the serving path for attention or MoE.
"""
