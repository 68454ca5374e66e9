"""The greedy LM head (kernels/native/greedy_head.c) gives torch.argmax(h @ w.T, -1): exactly, ties to
the lowest id, on integer-valued inputs (exact sums, so ties are common); the same ids on random floats;
torch's answers for rows of -inf / +inf logits; None (the torch path) for a NaN logit and for what it
cannot take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import native, ops
from kernels.native import greedy_head
from kernels.native.greedy_head import MAX_ROWS, MIN_ROWS, available, lm_head_argmax
from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model import mimo_v2
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler or native kernels off")


def head(n, k, generator, *, integer=False):
    w = torch.randint(-3, 4, (n, k), generator=generator).float() if integer else torch.randn(n, k, generator=generator)
    return ops.linear_weight_layout(w)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_integer_logits_ties_to_the_lowest_id(rows, k, n, seed):
    # small integers: every logit is exact in fp32 whatever the summation order, and equal logits
    # (ties) are frequent -- the ids must be torch.argmax's, first maximum included
    g = torch.Generator().manual_seed(seed)
    w = head(n, k, g, integer=True)
    h = torch.randint(-2, 3, (rows, k), generator=g).float()
    assert lm_head_argmax(h, w) == (h @ w.t()).argmax(-1).tolist()


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1031, 7), (4096, 64), (1500, 257)])
def test_integer_logits_of_wide_heads(rows, n, k):
    # 1-2 rows stream W^T front to back (4 rows of it per pass past 1024 columns), 3 take the tiles
    g = torch.Generator().manual_seed(rows * n + k)
    w, h = head(n, k, g, integer=True), torch.randint(-2, 3, (rows, k), generator=g).float()
    assert lm_head_argmax(h, w) == (h @ w.t()).argmax(-1).tolist()


def test_ties_are_common_in_the_integer_cases():
    g = torch.Generator().manual_seed(0)
    w, h = head(200, 3, g, integer=True), torch.randint(-2, 3, (40, 3), generator=g).float()
    logits = h @ w.t()
    tied = ((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).sum()
    assert tied > 20  # the property above exercises the tie rule, not luck
    assert lm_head_argmax(h, w) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("rows,n,k", [(1, 8192, 256), (32, 8192, 256), (7, 1000, 96), (64, 515, 33)])
def test_random_floats_give_torchs_ids(rows, n, k):
    g = torch.Generator().manual_seed(rows * n)
    w, h = head(n, k, g), torch.randn(rows, k, generator=g)
    got = lm_head_argmax(h, w)
    logits = h.double() @ w.double().t()
    top2 = logits.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # rows whose winner no fp32 rounding can change
    assert clear.sum() >= rows - 1
    ref = (h @ w.t()).argmax(-1).tolist()
    assert [a for a, c in zip(got, clear) if c] == [b for b, c in zip(ref, clear) if c]


def test_a_row_gets_the_same_id_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    w, h = head(777, 64, g), torch.randn(29, 64, generator=g)
    batch = lm_head_argmax(h, w)
    assert [lm_head_argmax(h[i:i + 1], w)[0] for i in range(29)] == batch


def test_infinite_logits_follow_torch():
    w = torch.randn(100, 8)
    h = torch.rand(3, 8) + 0.5  # positive: a column of +-inf weights gives a +-inf logit, never NaN
    w[:] = float("-inf")
    w = ops.linear_weight_layout(w)
    assert lm_head_argmax(h, w) == [0, 0, 0] == (h @ w.t()).argmax(-1).tolist()  # all -inf: id 0
    w2 = torch.randn(100, 8)
    w2[[37, 5, 80]] = float("inf")
    w2 = ops.linear_weight_layout(w2)
    assert lm_head_argmax(h, w2) == [5, 5, 5] == (h @ w2.t()).argmax(-1).tolist()  # the first +inf


def test_a_nan_logit_hands_the_step_to_torch():
    g = torch.Generator().manual_seed(1)
    w, h = head(300, 16, g), torch.randn(4, 16, generator=g)
    h[2, 3] = float("nan")
    assert lm_head_argmax(h, w) is None


def test_refuses_what_it_cannot_take(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w, h = head(64, 16, g), torch.randn(2, 16, generator=g)
    assert lm_head_argmax(h, w.contiguous()) is None  # row-major (a head tied to the embedding)
    assert lm_head_argmax(h.bfloat16(), w.bfloat16()) is None
    assert lm_head_argmax(h[:, :8], w) is None
    assert lm_head_argmax(torch.randn(MAX_ROWS + 1, 16), w) is None
    assert lm_head_argmax(torch.randn(0, 16), w) is None
    before = native.enabled()
    try:
        native.set_enabled(False)
        assert lm_head_argmax(h, w) is None
    finally:
        native.set_enabled(before)
    assert lm_head_argmax(h, w) == (h @ w.t()).argmax(-1).tolist()


# ---- the engine: greedy steps without logprobs take the fused head -----------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def _generate(model, prompts, params):
    cfg = EngineConfig(page_size=4, max_chunk_tokens=16, max_num_batched_tokens=64, num_full_tokens=2048,
                       num_swa_tokens=1024)
    return LLM.from_engine(LLMEngine(model, cfg)).generate(prompts, params)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_engine_tokens_equal_with_and_without_the_fused_head(tiny_model, batch, monkeypatch):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (batch,), generator=g)]
    calls = []

    def spy(h, w):
        ids = lm_head_argmax(h, w)
        calls.append(ids is not None)
        return ids

    monkeypatch.setattr(mimo_v2, "lm_head_argmax", spy)
    # logprobs asked: the logits and the sampler serve every step
    ref = _generate(tiny_model, prompts, SamplingParams(max_tokens=20, temperature=0.0, logprobs=0, ignore_eos=True))
    assert not calls
    fused = _generate(tiny_model, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    if batch < MIN_ROWS:
        assert not calls  # one row: MKL's GEMV and the sampler
    else:  # every step that samples 2+ rows (the prompts' last chunks and the decodes)
        assert len(calls) >= 19 and all(calls)
    assert [o.token_ids for o in fused] == [o.token_ids for o in ref]
    assert all(o.logprobs is None for o in fused)


@pytest.mark.usefixtures("one_thread")
def test_a_random_row_in_the_step_keeps_the_sampler(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr(mimo_v2, "lm_head_argmax", lambda h, w: calls.append(1) or lm_head_argmax(h, w))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = _generate(tiny_model, prompts[:2], greedy)
    n_alone = len(calls)
    calls.clear()
    llm = LLM.from_engine(LLMEngine(tiny_model, EngineConfig(page_size=4, num_full_tokens=2048, num_swa_tokens=1024)))
    mixed = llm.generate(prompts, [greedy, greedy, SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                                                  ignore_eos=True)])
    assert n_alone == 6 and not calls  # the three requests share every step, so none is all-greedy
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


@pytest.mark.usefixtures("one_thread")
def test_rows_past_what_the_build_serves_faster_keep_the_torch_path(tiny_model, monkeypatch):
    """A build without AVX-512 is faster than MKL's GEMM + argmax only while its GEMM streams the head
    (greedy_head_fast_rows: 8 on AVX2); past that the model computes the logits. Here the build's
    bound is 3 and five greedy requests decode together: steps of 2-3 sampling rows take the kernel,
    steps of 4-5 the logits, and the tokens are those of the logits alone."""
    lib = greedy_head._lib()
    monkeypatch.setattr(lib, "greedy_head_fast_rows", lambda: 3)
    assert [greedy_head.pays(r) for r in range(1, 6)] == [False, True, True, False, False]
    rows = []
    monkeypatch.setattr(mimo_v2, "lm_head_argmax", lambda h, w: rows.append(h.shape[0]) or lm_head_argmax(h, w))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 9, 14, 21, 30)]
    ref = _generate(tiny_model, prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True))
    assert not rows
    fused = _generate(tiny_model, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert rows and all(MIN_ROWS <= r <= 3 for r in rows)
    assert [o.token_ids for o in fused] == [o.token_ids for o in ref]


def test_every_build_serves_faster_from_two_rows():
    """What the model asks the kernel for: from MIN_ROWS rows to the build's bound (AVX-512: every call
    up to MAX_ROWS; AVX2 and others: the rows small_gemm.h streams, at least MIN_ROWS)."""
    fast = greedy_head._lib().greedy_head_fast_rows()
    assert fast >= MIN_ROWS
    assert not greedy_head.pays(MIN_ROWS - 1) and greedy_head.pays(MIN_ROWS)
    assert greedy_head.pays(min(fast, MAX_ROWS)) and not greedy_head.pays(min(fast, MAX_ROWS) + 1)
