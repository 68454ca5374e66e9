"""The engine gives the same greedy tokens (and logprobs to fp32 rounding) with the C kernels on and
off (``EngineConfig.native_cpu_kernels``), at batch 1 and 8, and the on run really used the kernels:
the MoE (router + experts), the layer glue around the attention and the dense MLP
(kernels/native/decoder_layer.c)."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.cpu import moe as moe_cpu
from kernels.native.moe_experts import available, moe_experts, moe_route_experts
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.layers import attention as attention_layer
from llm_core.model.layers import mlp as mlp_layer
from llm_core.model.layers import moe as moe_layer
from llm_core.model.layers.fused_decode import FusedDecode
from llm_core.model.layers.mlp import DenseMLP
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not available(), reason="no C compiler or native kernels off")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


@pytest.fixture
def restore_native():
    before = native.enabled()
    yield
    native.set_enabled(before)


def generate(model, prompts, native_on: bool):
    cfg = EngineConfig(page_size=4, max_chunk_tokens=16, max_num_batched_tokens=64, num_full_tokens=2048,
                       num_swa_tokens=1024, native_cpu_kernels=native_on)
    llm = LLM.from_engine(LLMEngine(model, cfg))
    return llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True))


@pytest.mark.parametrize("batch", [1, 8])
def test_tokens_equal_with_native_kernels_on_and_off(model, batch, monkeypatch, restore_native):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (batch,), generator=g)]
    served, glue = [], []

    def spy(kernel, calls=served):
        def call(*args, **kwargs):
            out = kernel(*args, **kwargs)
            calls.append((kernel.__name__, out is not None))
            return out
        return call

    # the router + experts call serves the layers; a layer it passes on reaches the experts kernel
    monkeypatch.setattr(moe_cpu, "moe_experts", spy(moe_experts))
    monkeypatch.setattr(moe_layer, "moe_route_experts", spy(moe_route_experts))
    for module, name in ((attention_layer, "attention_front"), (attention_layer, "attention_out"),
                         (mlp_layer, "dense_mlp")):
        monkeypatch.setattr(module, name, spy(getattr(module, name), glue))
    fused = []

    def fused_spy(real):
        def run(self, *args):
            out = real(self, *args)
            if out is not None:  # the layer's parts ran in C inside the one call
                fused.extend(("attention_front", "attention_out")
                             + (("dense_mlp",) if isinstance(self.mlp, DenseMLP) else ("moe_route_experts",)))
            return out
        return run

    # a decode step's layers, and a short prefill step's last one (its logits rows: run_rows)
    monkeypatch.setattr(FusedDecode, "run", fused_spy(FusedDecode.run))
    monkeypatch.setattr(FusedDecode, "run_rows", fused_spy(FusedDecode.run_rows))
    off = generate(model, prompts, native_on=False)
    assert not any(ok for _, ok in served + glue) and not fused
    served.clear()
    glue.clear()
    on = generate(model, prompts, native_on=True)
    # the MoE layers' router + experts ran in C: in their own call or inside a layer's one call
    assert (served or "moe_route_experts" in fused) and all(ok for _, ok in served)
    # every layer's glue and dense MLP ran in C: in their own calls (prompt chunks past the C attention's
    # short rows) or inside a decoder layer's one call (decode steps, short chunks)
    assert {name for name, ok in glue if ok} | set(fused) - {"moe_route_experts"} == {"attention_front", "attention_out",
                                                                                   "dense_mlp"}
    assert all(ok for _, ok in glue)
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
