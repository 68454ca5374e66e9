"""Block-FP8 expert weights (kernels/block_fp8.py) in the Triton fused-MoE kernel and on the CPU
paths, against the reference on the same weights dequantised: the kernel multiplies each fp8 tile by
its blocks' factors, so it must equal dequantise-then-multiply up to fp32 summation order. Kernel
tests run on CPU in a TRITON_INTERPRET=1 child (see test_kernels_support)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.kernels.test_kernels_moe import make_moe
from tests.kernels.test_kernels_support import DEVICE, interpreter_rerun, kernel_test, run_under_interpreter

from kernels import ops
from kernels.block_fp8 import BlockFP8, dequantize_blocks
from kernels.moe_ref import experts_ref
from kernels.moe_triton import fused_experts_triton


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


def fp8_moe(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, block: tuple[int, int]):
    """MoE inputs with block-FP8 weights (gate and up rows blocked as two groups) and the reference's
    output on exactly the values those weights hold."""
    x, w_gate_up, w_down, weights, ids = make_moe(seed, tokens, hidden, inter, experts, top_k)
    gu, dn = BlockFP8.quantize(w_gate_up * 3.0, block, groups=2), BlockFP8.quantize(w_down * 3.0, block)
    want = experts_ref(x, gu.dequantize(), dn.dequantize(), weights, ids)
    return (x, gu, dn, weights, ids), want


def to_device(b: BlockFP8) -> BlockFP8:
    return BlockFP8(b.values.to(DEVICE), b.scale_inv.to(DEVICE), b.block, b.groups)


@kernel_test
@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 20), hidden=st.sampled_from([24, 40]), inter=st.sampled_from([20, 36]),
       experts=st.integers(1, 5), top_k=st.integers(1, 3), seed=st.integers(0, 2**16),
       block=st.sampled_from([(16, 16), (8, 32), (32, 16)]), skipped=st.booleans())
def test_fp8_kernel_matches_dequantised_reference(tokens, hidden, inter, experts, top_k, seed, block, skipped) -> None:
    """Partial last blocks in both dims (sizes not multiples of the blocks), the up group's scale rows
    starting after the gate's, several K tiles per scale column (bk 32, block_k 16), skipped ids."""
    (x, gu, dn, weights, ids), want = fp8_moe(seed, tokens, hidden, inter, experts, min(top_k, experts), block)
    if skipped:
        mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
        want = experts_ref(x, gu.dequantize(), dn.dequantize(), weights.masked_fill(mask, 0.0), ids)
        ids = ids.masked_fill(mask, experts)
    out = fused_experts_triton(x.to(DEVICE), to_device(gu), to_device(dn), weights.to(DEVICE), ids.to(DEVICE),
                               block_m=16, block_n=16, block_k=16, skipped=skipped)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)


@kernel_test
def test_fp8_kernel_through_ops_with_default_blocks() -> None:
    """ops.fused_experts hands BlockFP8 stacks to the kernel as they are (block_k 64 shrinks to bk 32)."""
    (x, gu, dn, weights, ids), want = fp8_moe(3, 9, 40, 36, 4, 2, (32, 32))
    got = ops.fused_experts(x.to(DEVICE), to_device(gu), to_device(dn), weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@kernel_test
def test_fp8_kernel_with_bf16_activations() -> None:
    """bf16 activations: each tile is dequantised to bf16 in the kernel, so the output is the kernel's
    on the stacks dequantised to bf16 beforehand, up to bf16 rounding: the interpreter truncates its
    fp32 -> bf16 casts where torch (and a GPU) round to nearest, a bias of up to 2^-8 per weight and
    intermediate value (~1-2 % of the output's norm here; a wrong block factor is off by ~100 %)."""
    (x, gu, dn, weights, ids), _ = fp8_moe(5, 6, 40, 36, 4, 2, (16, 16))
    xb, w, i = x.to(torch.bfloat16).to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    want = fused_experts_triton(xb, gu.dequantize(torch.bfloat16).to(DEVICE), dn.dequantize(torch.bfloat16).to(DEVICE),
                                w, i, block_k=16)
    out = fused_experts_triton(xb, to_device(gu), to_device(dn), w, i, block_k=16)
    assert out.dtype == torch.bfloat16
    out, want = out.cpu().float(), want.cpu().float()
    assert (out - want).norm() / want.norm() < 3e-2


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 30), experts=st.integers(1, 5), top_k=st.integers(1, 3), skipped=st.booleans(),
       seed=st.integers(0, 2**16))
@example(tokens=28, experts=1, top_k=1, skipped=False, seed=9069)  # outputs up to 135: 1.5e-5 apart, one ulp
def test_fp8_on_cpu_paths(tokens, experts, top_k, skipped, seed) -> None:
    """The CPU paths dequantise and run the float experts: the same as the reference, up to fp32
    rounding of another summation order (a few ulps of the largest output; a wrong block factor is
    off by its whole scale)."""
    (x, gu, dn, weights, ids), want = fp8_moe(seed, tokens, 24, 20, experts, min(top_k, experts), (16, 16))
    if skipped:
        ids = ids.masked_fill(torch.zeros_like(ids, dtype=torch.bool).index_fill_(0, torch.tensor([0]), True), experts)
        want = experts_ref(x, gu.dequantize(), dn.dequantize(), weights.masked_fill(ids == experts, 0.0),
                           ids.clamp_max(experts - 1))
    atol = max(1e-5, 8 * torch.finfo(torch.float32).eps * want.abs().max().item())
    torch.testing.assert_close(ops.fused_experts(x, gu, dn, weights, ids, skipped=skipped), want, atol=atol, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 70), groups=st.sampled_from([1, 2]),
       block=st.sampled_from([(16, 16), (128, 128), (7, 5)]), seed=st.integers(0, 2**16))
def test_quantize_round_trip_and_group_scales(n, k, groups, block, seed) -> None:
    """Each group's blocks are quantised on their own (a group's scale rows never mix the other
    group's rows) and dequantising gives the weight back within e4m3's rounding (2^-4 relative of
    each block's largest value)."""
    w = torch.randn(2, groups * n, k, generator=torch.Generator().manual_seed(seed))
    q = BlockFP8.quantize(w, block, groups)
    q.check("w")
    back = q.dequantize()
    for g in range(groups):
        part = w[:, g * n:(g + 1) * n]
        alone = BlockFP8.quantize(part, block)
        assert torch.equal(q.values[:, g * n:(g + 1) * n].view(torch.uint8), alone.values.view(torch.uint8))
        assert torch.equal(back[:, g * n:(g + 1) * n], alone.dequantize())
    assert ((back - w).abs() <= w.abs().amax() * 2.0**-4 + 1e-6).all()
    assert torch.equal(dequantize_blocks(q.values[:, :n], q.scale_inv[:, :q.group_scale_rows], block), back[:, :n])


def test_fp8_wrapper_rejects_bad_inputs() -> None:
    (x, gu, dn, weights, ids), _ = fp8_moe(0, 2, 24, 20, 2, 1, (16, 16))
    with pytest.raises(ValueError, match="both be BlockFP8"):
        fused_experts_triton(x, gu, dn.dequantize(), weights, ids)
    with pytest.raises(ValueError, match="scale_inv shape"):
        fused_experts_triton(x, BlockFP8(gu.values, gu.scale_inv[:, :1], gu.block, 2), dn, weights, ids)
    with pytest.raises(ValueError, match="2 row groups"):
        fused_experts_triton(x, BlockFP8.quantize(gu.dequantize(), (16, 16)), dn, weights, ids)
    with pytest.raises(ValueError, match="float8"):
        fused_experts_triton(x, BlockFP8(gu.values.float(), gu.scale_inv, gu.block, 2), dn, weights, ids)
    with pytest.raises(ValueError, match="contiguous in its last dim"):  # the kernels step along a scale row by 1
        fused_experts_triton(x, BlockFP8(gu.values, gu.scale_inv.mT.contiguous().mT, gu.block, 2), dn, weights, ids)
    with pytest.raises(ValueError, match="power of two"):
        fused_experts_triton(x, BlockFP8.quantize(gu.dequantize(), (16, 8), 2), BlockFP8.quantize(dn.dequantize(), (16, 8)),
                             weights, ids)
