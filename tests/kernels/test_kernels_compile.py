"""Every Triton kernel compiles for an H100/H200 (sm_90) with the real MiMo-V2.5 shapes and bf16.

No GPU is needed: Triton's CUDA backend lowers to PTX and runs its bundled ptxas to a cubin. The
interpreter tests prove the kernels compute the right thing; this proves the same source is valid
GPU Triton (block shapes legal for tl.dot, constexpr branches, types), that both dot chunks of the
192-dim head are accepted, and that the shared memory each config needs fits an H200 SM (228 KiB).
Runs in the main process (the kernels must not be interpreter objects here).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import band_attention_triton as band  # noqa: E402
from kernels import kv_copy_triton as kv  # noqa: E402
from kernels import moe_triton as moe  # noqa: E402
from kernels import paged_attention_triton as paged  # noqa: E402

H200_SHARED_BYTES = 232448

ATTN_PTRS = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "sinks_ptr": "*bf16",
             "block_table_ptr": "*i64", "qsl_ptr": "*i64", "seq_lens_ptr": "*i64", "cu_ptr": "*i64"}
ATTN_SCALARS = {"scale_log2": "fp32"}
MOE_PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "inter_ptr": "*bf16", "y_ptr": "*fp32", "weights_ptr": "*fp32",
            "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "s_ptr": "*bf16"}
MOE_FP8_PTRS = {**MOE_PTRS, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}  # --fp8-experts: e4m3 weights, fp32 block factors
KV_PTRS = {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64",
           "src_ptr": "*bf16", "dst_ptr": "*bf16", "valid_ptr": "*u8"}

# (kernel, pointer types, constexprs): one entry per configuration the wrappers pick on the real model.
CASES = {
    "paged_swa_decode": (paged.paged_attention_kernel, ATTN_PTRS, dict(
        GROUP=8, HEAD_DIM=192, V_DIM=128, PAGE_SIZE=16, BLOCK_Q=2, BLOCK_G=8, BLOCK_N=64, BLOCK_D0=128,
        BLOCK_D1=64, BLOCK_DV=128, HAS_WINDOW=True, HAS_SINKS=True, DOT_PRECISION="tf32", NUM_SPLITS=1)),
    "paged_full_decode_split": (paged.paged_attention_kernel, ATTN_PTRS, dict(
        GROUP=16, HEAD_DIM=192, V_DIM=128, PAGE_SIZE=16, BLOCK_Q=1, BLOCK_G=16, BLOCK_N=64, BLOCK_D0=128,
        BLOCK_D1=64, BLOCK_DV=128, HAS_WINDOW=False, HAS_SINKS=False, DOT_PRECISION="tf32", NUM_SPLITS=8)),
    "paged_combine_splits": (paged.combine_splits_kernel, ATTN_PTRS, dict(
        V_DIM=128, BLOCK_DV=128, NUM_SPLITS=8, BLOCK_S=8)),
    "paged_full_extend": (paged.paged_attention_kernel, ATTN_PTRS, dict(
        GROUP=16, HEAD_DIM=192, V_DIM=128, PAGE_SIZE=16, BLOCK_Q=4, BLOCK_G=16, BLOCK_N=64, BLOCK_D0=128,
        BLOCK_D1=64, BLOCK_DV=128, HAS_WINDOW=False, HAS_SINKS=False, DOT_PRECISION="tf32", NUM_SPLITS=1)),
    "band_vision": (band.band_attention_kernel, ATTN_PTRS, dict(
        GROUP=4, HEAD_DIM=64, V_DIM=64, BLOCK_Q=16, BLOCK_G=4, BLOCK_N=64, BLOCK_D0=64, BLOCK_D1=0,
        BLOCK_DV=64, HAS_WINDOW=True, HAS_SINKS=True, DOT_PRECISION="tf32")),
    "moe_gate_up": (moe.moe_gate_up_kernel, MOE_PTRS, dict(
        TOP_K=8, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32", HAS_SCALE=False)),
    "moe_down": (moe.moe_down_kernel, MOE_PTRS, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32",
                                                     HAS_SCALE=False)),
    "moe_gate_up_fp8": (moe.moe_gate_up_kernel, MOE_FP8_PTRS, dict(
        TOP_K=8, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32", HAS_SCALE=True)),
    "moe_down_fp8": (moe.moe_down_kernel, MOE_FP8_PTRS, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
                                                             DOT_PRECISION="tf32", HAS_SCALE=True)),
    # decode-sized FP8 calls: a whole 128-column scale block per K tile
    "moe_gate_up_fp8_decode": (moe.moe_gate_up_kernel, MOE_FP8_PTRS, dict(
        TOP_K=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32", HAS_SCALE=True)),
    "moe_down_fp8_decode": (moe.moe_down_kernel, MOE_FP8_PTRS, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                                                    DOT_PRECISION="tf32", HAS_SCALE=True)),
    "store_kv": (kv.store_kv_kernel, KV_PTRS, dict(
        NUM_HEADS=8, HEAD_DIM=192, V_DIM=128, BLOCK_KD=256, BLOCK_VD=128)),
    "gather_valid": (kv.copy_rows_kernel, KV_PTRS, dict(GATHER=True, HAS_VALID=True, BLOCK=1024)),
    "scatter": (kv.copy_rows_kernel, KV_PTRS, dict(GATHER=False, HAS_VALID=False, BLOCK=1024)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_for_sm90(name: str) -> None:
    kernel, ptrs, constexprs = CASES[name]
    if not isinstance(kernel, JITFunction):
        pytest.skip("kernels were built for the interpreter in this process")
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        else:
            signature[arg] = ptrs.get(arg) or ATTN_SCALARS.get(arg, "i32")
    missing = [a for a in constexprs if a not in kernel.arg_names]
    assert not missing, f"stale constexpr names {missing}"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= H200_SHARED_BYTES
