"""The C draft steps (kernels/native/mtp_draft.c) draft the tokens of the torch FusedDraft steps
(llm_core/engine/speculative/fused_draft.py) on random weights: batch 1 to 12, k 1 to 3, windows 3 to
8, with and without the attention sinks, requests with fewer cached positions than W - 1 beside ones
far past the window; inputs the kernel cannot take go to the torch path; a released page under the
window and a token outside the vocabulary raise instead of reading past a buffer."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import native
from kernels.native import mtp_draft
from llm_core.engine.speculative.fused_draft import FusedDraft
from llm_core.model.loader import load_model
from llm_core.model.mtp import mtp_head_of
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not mtp_draft.available(), reason="no C compiler or native kernels off")]

PAGE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("cdraft") / "hf", mtp_layers=1))


def fused_for(model, window: int | None = None) -> FusedDraft:
    fused = FusedDraft(mtp_head_of(model).layers[0], model.model.embed_tokens, model.lm_head, max_draft=3)
    if window is not None:
        fused.window = window  # the draft's own window (the buffers follow it)
    return fused


@contextlib.contextmanager
def kernels_on(on: bool):
    before = native.enabled()
    native.set_enabled(on)
    try:
        yield
    finally:
        native.set_enabled(before)


def case(fused: FusedDraft, positions: list[int], seed: int):
    """Random pending tokens, hidden states, a random SWA pool and page tables covering each request."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [(c + 3) // PAGE + 1 for c in positions]
    total = sum(pages_needed) + 3
    order = torch.randperm(total, generator=g).tolist()
    swa_pages, at = [], 0
    for n in pages_needed:
        swa_pages.append(order[at:at + n])
        at += n
    k_cache = torch.randn(total * PAGE, fused.hkv, fused.d, generator=g)
    v_cache = torch.randn(total * PAGE, fused.hkv, fused.dv, generator=g)
    h_prev = torch.randn(len(positions), fused.layer.eh_proj.weight.shape[0], generator=g)
    tokens = torch.randint(0, fused.embed.weight.shape[0], (len(positions),), generator=g).tolist()
    return tokens, positions, h_prev, swa_pages, PAGE, k_cache, v_cache


def both(fused: FusedDraft, args, k: int) -> tuple[list[list[int]], list[list[int]], int]:
    """(C tokens, torch tokens, C calls that served)."""
    served = []
    real = mtp_draft.DraftKernel.draft

    def counting(self, *a):
        out = real(self, *a)
        served.append(out is not None)
        return out

    mtp_draft.DraftKernel.draft = counting
    try:
        with kernels_on(True):
            got = fused.draft(*args, k)
    finally:
        mtp_draft.DraftKernel.draft = real
    with kernels_on(False):
        want = fused.draft(*args, k)
    return got, want, sum(served)


@pytest.mark.parametrize("window", [3, 5, 8])
@pytest.mark.parametrize("sinks", [True, False])
def test_c_draft_tokens_equal_the_torch_steps(model, window, sinks):
    layer = mtp_head_of(model).layers[0].self_attn
    saved = layer.attention_sink_bias
    assert saved is not None  # the tiny checkpoint's sliding MTP layer has sinks
    try:
        if not sinks:
            layer.attention_sink_bias = None
        fused = fused_for(model, window)
        drafts = set()
        for seed, positions in enumerate([[1], [2], [window + 30], [1, 2, window - 1, 57, 300],
                                          [window, 3], [9, 2, 1], list(range(1, 25, 2))]):  # 12: register tiles
            for k in (1, 2, 3):
                got, want, served = both(fused, case(fused, positions, seed * 10 + k), k)
                assert got == want, f"positions {positions}, k {k}"
                assert served == 1 and all(len(t) == k for t in got)
                drafts.update(tuple(t) for t in got)
        assert len(drafts) > 10  # not one repeated guess
    finally:
        layer.attention_sink_bias = saved


def test_refolds_after_a_weight_changes_in_place(model):
    fused = fused_for(model)
    args = case(fused, [5, 20], seed=3)
    before, _, _ = both(fused, args, 3)
    w = mtp_head_of(model).layers[0].mlp.down_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(-4.0)
        got, want, served = both(fused, args, 3)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert got == want and served == 1 and got != before


def test_inputs_the_kernel_cannot_take_go_to_the_torch_path(model):
    fused = fused_for(model)
    tokens, positions, h_prev, pages, ps, k_cache, v_cache = case(fused, [6, 11], seed=5)
    # fp64 hidden states and a non-contiguous pool: the kernel declines, the torch path drafts
    for args in [(tokens, positions, h_prev.double(), pages, ps, k_cache, v_cache),
                 (tokens, positions, h_prev, pages, ps, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache)]:
        got, want, served = both(fused, args, 2)
        assert got == want and served == 0


def test_bad_indices_raise_before_reading(model):
    fused = fused_for(model)
    tokens, positions, h_prev, pages, ps, k_cache, v_cache = case(fused, [9], seed=7)
    released = [list(pages[0])]
    released[0][(positions[0] - 1) // ps] = -1
    with kernels_on(True), pytest.raises(RuntimeError, match="released"):
        fused.draft(tokens, positions, h_prev, released, ps, k_cache, v_cache, 2)
    with kernels_on(True), pytest.raises(ValueError, match="out of range"):
        fused.draft([fused.embed.weight.shape[0]], positions, h_prev, pages, ps, k_cache, v_cache, 2)
    with kernels_on(True), pytest.raises(ValueError, match="out of range"):  # a page past the pool's end
        fused.draft(tokens, positions, h_prev, [[p + 1000 for p in pages[0]]], ps, k_cache, v_cache, 2)
