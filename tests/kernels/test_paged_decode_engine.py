"""An engine with the C decode attention (``native_cpu_kernels``, the default) decodes the same tokens,
with logprobs to fp32 rounding, as one with it off, at batch 1 and 8 on the tiny model (full and sliding
layers, sinks, q/k dim 24 != v dim 16, contexts past the window and across pages), and the kernel served
every decode step's attention (in its own call or inside a decoder layer's one call, fused_layer.c)."""

from __future__ import annotations

import pytest
import torch

from kernels.native import build, fused_layer, paged_decode
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(paged_decode._lib() is None, reason="no C compiler: the torch path serves")]


def _generate(ckpt, prompts: list[list[int]], native: bool):
    cfg = EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=8,
                       max_num_batched_tokens=256, native_cpu_kernels=native)
    llm = LLM.from_engine(LLMEngine(load_model(ckpt, dtype=torch.float32), cfg))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 8])
def test_tokens_identical_with_the_c_kernel_on_and_off(ckpt, monkeypatch, batch):
    monkeypatch.setattr(build, "_enabled", build.enabled())  # the engines flip the process switch: restore it
    calls = []

    def counted(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            calls.append(out is not None)
            return out
        return call

    monkeypatch.setattr(paged_decode, "decode_attention", counted(paged_decode.decode_attention))
    monkeypatch.setattr(fused_layer, "decode_layer", counted(fused_layer.decode_layer))
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(5, 30, (batch,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    on = _generate(ckpt, prompts, native=True)
    assert calls and all(calls)  # every layer of every decode step went through the kernel
    calls.clear()
    off = _generate(ckpt, prompts, native=False)
    assert not calls
    for (toks, lps), (rtoks, rlps) in zip(on, off):
        assert toks == rtoks
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(rlps), rtol=0, atol=1e-5)
