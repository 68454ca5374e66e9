"""Triton paged attention (decode + extend, full + sliding, sinks, GQA, D != Dv) vs the torch reference.

On CPU the kernel tests run in a TRITON_INTERPRET=1 child (see test_kernels_support).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.kernels.test_kernels_support import (DEVICE, interpreter_rerun, kernel_test, paged_layout, poison_invisible,
                                  run_under_interpreter)

from kernels import ops
from kernels.attention_ref import paged_attention_ref
from kernels.paged_attention_triton import dim_blocks, paged_attention_triton

ATOL = 1e-4


@interpreter_rerun
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_under_interpreter(__file__, request.config)


def make_case(seed: int, seq_lens: list[int], new_tokens: list[int], *, page_size: int, num_heads: int,
              num_kv: int, head_dim: int, v_dim: int, window: int | None, with_sinks: bool):
    gen = torch.Generator().manual_seed(seed)
    table, num_pages, ranges = paged_layout(gen, seq_lens, page_size, window, new_tokens)
    slots = num_pages * page_size
    k_cache = torch.randn(slots, num_kv, head_dim, generator=gen)
    v_cache = torch.randn(slots, num_kv, v_dim, generator=gen)
    poison_invisible(k_cache, table, ranges, page_size)
    poison_invisible(v_cache, table, ranges, page_size)
    q = torch.randn(sum(new_tokens), num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int64)
    sinks = torch.randn(num_heads, generator=gen) * 2 if with_sinks else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, query_start_loc=qsl,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64), page_size=page_size, window=window, sinks=sinks)


def check(case: dict, scale: float = 0.3, block_n: int = 64, num_splits: int | None = None) -> None:
    ref = paged_attention_ref(**{k: v for k, v in case.items()}, scale=scale)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and k not in ("query_start_loc", "seq_lens") else v)
           for k, v in case.items()}
    out = paged_attention_triton(**dev, scale=scale, block_n=block_n, num_splits=num_splits).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)


@st.composite
def batches(draw):
    num_req = draw(st.integers(1, 4))
    seq_lens, new_tokens = [], []
    for _ in range(num_req):
        kind = draw(st.sampled_from(["decode", "extend", "prefill"]))
        n = draw(st.integers(1, 40))
        new = 1 if kind == "decode" else (n if kind == "prefill" else draw(st.integers(1, n)))
        seq_lens.append(n)
        new_tokens.append(new)
    num_kv = draw(st.integers(1, 2))
    return dict(
        seed=draw(st.integers(0, 2**16)), seq_lens=seq_lens, new_tokens=new_tokens,
        page_size=draw(st.sampled_from([1, 3, 4, 16])), num_kv=num_kv,
        num_heads=num_kv * draw(st.sampled_from([1, 2, 3, 4])),
        head_dim=draw(st.sampled_from([8, 24, 40])), v_dim=draw(st.sampled_from([8, 20])),
        window=draw(st.one_of(st.none(), st.integers(1, 20))), with_sinks=draw(st.booleans()),
    )


@kernel_test
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batches(), block_n=st.sampled_from([16, 64]), num_splits=st.sampled_from([None, 1, 3]))
def test_matches_reference_on_mixed_batches(spec: dict, block_n: int, num_splits: int | None) -> None:
    """Decode, extend and prefill requests in one batch, with and without split-KV; NaN-poisoned
    invisible slots prove the kernel reads nothing outside each query's window (released pages too)."""
    check(make_case(**spec), block_n=block_n, num_splits=num_splits)


@kernel_test
@pytest.mark.parametrize("window,with_sinks,num_kv", [(None, False, 1), (7, True, 2)])
def test_real_head_geometry(window: int | None, with_sinks: bool, num_kv: int) -> None:
    """MiMo head dims (q/k 192 split 128+64, v 128) with GA-like (16:1) and SWA-like (8:1) groups."""
    group = 16 if window is None else 8
    case = make_case(1, [23, 9, 1], [1, 9, 1], page_size=4, num_heads=group * num_kv, num_kv=num_kv,
                     head_dim=192, v_dim=128, window=window, with_sinks=with_sinks)
    check(case, scale=192**-0.5, block_n=16)
    check(case, scale=192**-0.5, block_n=16, num_splits=2)


@kernel_test
def test_window_edge_inside_a_page_and_single_token_sequence() -> None:
    # window 5, page 4, query at position 13: keys 9..13 -> page 2 (8..11) straddles the edge,
    # pages 0 and 1 are released; second request is a single-token sequence.
    case = make_case(2, [14, 1], [1, 1], page_size=4, num_heads=2, num_kv=1, head_dim=24, v_dim=20,
                     window=5, with_sinks=True)
    assert case["block_table"][0, :2].tolist() == [-1, -1] and case["block_table"][0, 2] >= 0
    check(case, block_n=16)


@kernel_test
def test_request_without_new_tokens_and_dispatch_through_ops() -> None:
    case = make_case(3, [5, 6, 4], [2, 0, 4], page_size=3, num_heads=4, num_kv=2, head_dim=12, v_dim=12,
                     window=None, with_sinks=False)
    ref = paged_attention_ref(**case, scale=0.5)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and k not in ("query_start_loc", "seq_lens") else v)
           for k, v in case.items()}
    out = ops.paged_attention(**dev, scale=0.5).cpu()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)


@kernel_test
def test_large_sink_saturates_without_overflow() -> None:
    # sink logit 200 >> every key logit: all mass goes to the sink (output ~0), no inf/NaN.
    case = make_case(4, [6], [6], page_size=2, num_heads=1, num_kv=1, head_dim=8, v_dim=8,
                     window=None, with_sinks=True)
    case["sinks"] = torch.tensor([200.0])
    check(case)


def test_dim_blocks_split_without_waste() -> None:
    assert dim_blocks(192) == (128, 64)
    assert dim_blocks(128) == (128, 0)
    assert dim_blocks(24) == (16, 16)
    assert dim_blocks(8) == (16, 0)
    for d in range(1, 300):
        a, b = dim_blocks(d)
        assert a + b >= d and a >= 16 and (b == 0 or b >= 16)


def test_wrapper_rejects_bad_inputs() -> None:
    case = make_case(5, [4], [1], page_size=2, num_heads=4, num_kv=2, head_dim=8, v_dim=8, window=None,
                     with_sinks=False)
    bad = [
        (dict(q=case["q"].double()), "dtype"),
        (dict(q=torch.randn(1, 3, 8)), "do not split"),
        (dict(q=torch.randn(1, 4, 6)), "head dim"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(page_size=0), "page_size"),
        (dict(window=0), "window"),
        (dict(query_start_loc=torch.tensor([0, 2])), "query_start_loc"),
        (dict(block_table=case["block_table"].float()), "block_table"),
        (dict(k_cache=case["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ]
    for override, words in bad:
        with pytest.raises(ValueError, match=words):
            paged_attention_triton(**{**case, **override}, scale=1.0)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_caches(dtype: torch.dtype) -> None:
    """bf16/fp16 q and pool (the GPU serving dtypes): fp32 accumulation, one rounding of the output."""
    case = make_case(6, [21, 7], [1, 7], page_size=4, num_heads=4, num_kv=2, head_dim=40, v_dim=24,
                     window=6, with_sinks=True)
    for key in ("q", "k_cache", "v_cache"):
        case[key] = torch.nan_to_num(case[key]).to(dtype)
    ref = paged_attention_ref(**case, scale=0.2).float()
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and k not in ("query_start_loc", "seq_lens") else v)
           for k, v in case.items()}
    out = paged_attention_triton(**dev, scale=0.2, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("with_sinks", [False, True])
def test_split_kv_decode_with_more_splits_than_tiles(with_sinks: bool) -> None:
    """Long-context decode split 5 ways over 3 key tiles: empty splits must not disturb the merge, and
    the sink is counted exactly once."""
    case = make_case(8, [40, 3], [1, 1], page_size=8, num_heads=4, num_kv=1, head_dim=16, v_dim=16,
                     window=None, with_sinks=with_sinks)
    check(case, block_n=16, num_splits=5)


@kernel_test
@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (9, True)])
def test_decode_keys_bound_with_many_empty_splits(window: int | None, with_sinks: bool) -> None:
    """A CUDA-graph decode step's call (``decode_keys``: the host-known bound; lengths unread on the
    host): 16 splits captured for the longest context serve requests of 40, 3 and 1 tokens -- most of
    their splits are empty -- exactly, with the sink counted once and the window kept."""
    case = make_case(9, [40, 3, 1], [1, 1, 1], page_size=4, num_heads=4, num_kv=2, head_dim=24, v_dim=16,
                     window=window, with_sinks=with_sinks)
    ref = paged_attention_ref(**case, scale=0.3)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out = paged_attention_triton(**dev, scale=0.3, block_n=16, num_splits=16, decode_keys=64).cpu()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="decode_keys"):
        paged_attention_triton(**dev, scale=0.3, decode_keys=0)


@settings(max_examples=200, deadline=None)
@given(sms=st.integers(1, 200), programs=st.integers(1, 4096), keys=st.integers(1, 1 << 20))
def test_split_count_rule(sms: int, programs: int, keys: int) -> None:
    """Key splits: a power of two in [1, 16], at least 256 keys a split (but one), no more programs
    than ~2 waves of SMs need; more keys never fewer splits, more programs never more."""
    from kernels.paged_attention_triton import split_count

    n = split_count(sms, programs, keys)
    assert 1 <= n <= 16 and n & (n - 1) == 0
    assert n == 1 or (keys > 256 * (n - 1) and programs * n <= 2 * sms + programs)
    assert split_count(sms, programs, keys * 2) >= n
    assert split_count(sms, programs * 2, keys) <= n


def test_long_context_decode_on_few_programs_splits() -> None:
    """The rule's point: one request over 32k keys on a 132-SM GPU's 4 KV heads gets 16 splits; a
    batch of 128 (512 programs: two waves already) and a 128-key window get none."""
    from kernels.paged_attention_triton import split_count

    assert split_count(132, 1 * 4, 32768) == 16
    assert split_count(132, 128 * 4, 32768) == 1
    assert split_count(132, 1 * 8, 128) == 1
    assert split_count(132, 8 * 4, 4096) == 8  # min(cdiv(264, 32) = 9, 16, 16) -> 8


def test_auto_splits_reads_host_lengths_else_the_decode_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which longest context the split rule reads: host lengths when it has them; with lengths on
    the device (a captured step) the caller's bound, and without one no split (reading would sync)."""
    from types import SimpleNamespace

    import kernels.paged_attention_triton as pat

    monkeypatch.setattr(pat, "_sm_count", lambda index: 132)
    cuda_q = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    host_lens, device_lens = torch.tensor([5000, 20]), SimpleNamespace(is_cuda=True)
    assert pat.auto_splits(cuda_q, host_lens, None, 4) == 16
    assert pat.auto_splits(cuda_q, host_lens, 128, 4) == 1  # a 128-key window: nothing to split
    assert pat.auto_splits(cuda_q, device_lens, None, 4) == 1
    assert pat.auto_splits(cuda_q, device_lens, None, 4, decode_keys=4096) == 16
    assert pat.auto_splits(cuda_q, device_lens, None, 4, decode_keys=300) == 2
    assert pat.auto_splits(SimpleNamespace(is_cuda=False), host_lens, None, 4, decode_keys=4096) == 1


@kernel_test
@pytest.mark.skipif(not torch.cuda.is_available(), reason="key splits are chosen for CUDA's SMs only")
def test_device_lengths_split_by_the_decode_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel as a CUDA-graph decode step calls it (lengths on the device): without a bound it
    cannot split, with ``decode_keys`` it launches the merge of as many splits as the rule gives,
    and the result is the reference's."""
    import kernels.paged_attention_triton as pat

    merges: list[int] = []
    real = pat.combine_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                merges.append(kwargs["NUM_SPLITS"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pat, "combine_splits_kernel", Spy())
    case = make_case(10, [3000], [1], page_size=16, num_heads=16, num_kv=1, head_dim=64, v_dim=64,
                     window=None, with_sinks=True)
    ref = paged_attention_ref(**case, scale=0.125)
    dev = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    torch.testing.assert_close(pat.paged_attention_triton(**dev, scale=0.125).cpu(), ref, atol=ATOL, rtol=1e-4)
    assert merges == []
    out = pat.paged_attention_triton(**dev, scale=0.125, decode_keys=4096)
    assert merges == [pat.device_splits(dev["q"].device, 1, 4096, None)] and merges[0] > 1
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=1e-4)
