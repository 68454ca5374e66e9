"""Weights and KV pool on huge-page-advised memory (kernels/cpu/huge_pages.py, ``EngineConfig.huge_pages``):
only where the bytes live changes -- values, shapes, strides and sharing stay, and an engine with it
on decodes the same tokens with bit-identical logprobs as one with it off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu import huge_pages
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model

needs_thp = pytest.mark.skipif(not huge_pages.supported(), reason="no transparent huge pages on this host")


def _arena_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage under two modules
        self.proj = nn.Linear(8, 6)
        self.proj.weight.data = self.proj.weight.data.t().contiguous().t()  # column-major, as the kernels lay it
        self.register_buffer("table", torch.arange(12.0).view(3, 4)[:, 1:])  # a strided view with an offset


@needs_thp
def test_move_keeps_values_strides_and_tying():
    m = _Tied()
    before = {k: (v.clone(), v.stride()) for k, v in m.state_dict(keep_vars=True).items()}
    emb_param = m.embed.weight
    moved = huge_pages.move_module_(m)
    assert moved > 0
    state = m.state_dict(keep_vars=True)
    for k, (value, stride) in before.items():
        assert torch.equal(state[k], value), k
        assert state[k].stride() == stride, k
    assert m.embed.weight is emb_param and m.head.weight is m.embed.weight  # the same Parameter, still tied
    arenas = {_arena_of(t) for t in state.values()}
    assert len(arenas) == 1  # every tensor in one arena
    assert not m.proj.weight.is_contiguous() and m.proj.weight.t().is_contiguous()
    x = torch.randn(3, 8)
    assert torch.equal(m.proj(x), nn.functional.linear(x, before["proj.weight"][0], before["proj.bias"][0]))
    assert huge_pages.move_module_(m) == 0  # idempotent: already in an arena
    assert {_arena_of(t) for t in m.state_dict(keep_vars=True).values()} == arenas


@needs_thp
def test_zeros_are_zero_disjoint_and_contiguous():
    shapes = [(5, 2, 3), (7, 1, 4), (1,)]
    ts = huge_pages.zeros(shapes, torch.float32)
    assert [tuple(t.shape) for t in ts] == shapes
    for t in ts:
        assert t.is_contiguous() and t.dtype is torch.float32 and not t.any()
        assert t.data_ptr() % 64 == 0
    ts[0].fill_(1.0)
    assert not ts[1].any() and not ts[2].any()  # no overlap
    assert huge_pages.empty(0).numel() == 0
    with pytest.raises(ValueError):
        huge_pages.empty(-1)


def test_unsupported_host_moves_nothing(monkeypatch):
    monkeypatch.setattr(huge_pages, "supported", lambda: False)
    m = nn.Linear(4, 4)
    ptr = m.weight.data_ptr()
    assert huge_pages.move_module_(m) == 0 and m.weight.data_ptr() == ptr


def _generate(ckpt, prompts: list[list[int]], huge: bool):
    cfg = EngineConfig(page_size=4, num_full_tokens=4096, num_swa_tokens=2048, max_num_seqs=8,
                       max_num_batched_tokens=256, huge_pages=huge)
    engine = LLMEngine(load_model(ckpt, dtype=torch.float32), cfg)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = [(o.token_ids, o.logprobs) for o in LLM.from_engine(engine).generate(prompts, params)]
    return outs, engine


@needs_thp
@pytest.mark.usefixtures("one_thread")
def test_engine_tokens_and_logprobs_identical_with_huge_pages(ckpt):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    off, eng_off = _generate(ckpt, prompts, huge=False)
    on, eng_on = _generate(ckpt, prompts, huge=True)
    assert on == off  # same bits: only where the weights and K/V live changed
    weights = [p for p in eng_on.runner.model.parameters()]
    assert len({_arena_of(p) for p in weights}) == 1
    k, v = eng_on.pool.layer(0)
    assert _arena_of(k) == _arena_of(v) and _arena_of(k) not in {_arena_of(p) for p in weights}
    assert len({_arena_of(p) for p in eng_off.runner.model.parameters()}) > 1  # off: torch's own storages
