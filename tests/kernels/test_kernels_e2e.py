"""A tiny MiMo model end to end with every op on the Triton path == the torch path (greedy tokens).

The engine runs chunked prefill (chunks smaller than the window and not page-aligned) and decode in
mixed batches, so this exercises store_kv, paged attention (full + sliding with sinks, 24/16 dims)
and fused MoE exactly as the model calls them. On CPU it runs in a TRITON_INTERPRET=1 child.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_kernels_support import DEVICE, IN_CHILD, interpreter_rerun, kernel_test, run_under_interpreter

from kernels import ops

pytest.importorskip("transformers")


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


def generate(model, prompts: list[list[int]], max_tokens: int):
    from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams

    # compile_decode off: on CUDA the decode graphs (on by default there) keep a scratch page of each
    # pool for good, which the all_free() check below would count; test_decode_graphs covers them
    config = EngineConfig(page_size=4, max_chunk_tokens=5, max_num_batched_tokens=16, num_full_tokens=512,
                          num_swa_tokens=256, compile_decode=False)
    llm = LLM.from_engine(LLMEngine(model, config))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts), [o.error for o in outs]
    llm.engine.prefix_cache.clear()  # on by default; what it keeps must be all it holds
    assert llm.engine.pool.all_free()
    return outs


@kernel_test
def test_greedy_tokens_match_torch_path(tmp_path) -> None:
    from llm_core.model.loader import load_model
    from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

    ckpt = build_tiny_hf_checkpoint(tmp_path / "tiny")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (13, 4, 9)]  # > and < window 8
    ops.force_triton(False)  # CPU tensors -> torch references
    try:
        reference = generate(load_model(ckpt, dtype=torch.float32, device="cpu"), prompts, 6)
    finally:
        ops.force_triton(IN_CHILD)
    triton_path = generate(load_model(ckpt, dtype=torch.float32, device=DEVICE), prompts, 6)
    for ref, got in zip(reference, triton_path):
        assert got.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-3


@kernel_test
def test_fp8_experts_greedy_tokens_match_torch_path(tmp_path) -> None:
    """The routed experts kept in block-FP8 (an FP8 hub checkpoint's as stored): the Triton expert
    kernels read them as stored and give the tokens of the torch path, which dequantises them."""
    from llm_core.model.loader import load_model
    from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout

    ckpt = write_hub_layout(build_tiny_hf_checkpoint(tmp_path / "tiny"), tmp_path / "hub", fp8=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (13, 5)]
    ops.force_triton(False)
    try:
        reference = generate(load_model(ckpt, dtype=torch.float32, device="cpu", fp8_experts=True), prompts, 5)
    finally:
        ops.force_triton(IN_CHILD)
    model = load_model(ckpt, dtype=torch.float32, device=DEVICE, fp8_experts=True)
    assert model.model.layers[2].mlp.experts.fp8_block is not None
    triton_path = generate(model, prompts, 5)
    for ref, got in zip(reference, triton_path):
        assert got.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-3
