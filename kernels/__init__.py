"""Attention, MoE and KV-copy kernels: Triton on CUDA, torch references everywhere.

Callers use the dispatch functions in :mod:`kernels.ops`; they pick the Triton path for CUDA tensors
and the torch reference otherwise. Each reference lives next to its kernel and is what tests compare to.
"""
