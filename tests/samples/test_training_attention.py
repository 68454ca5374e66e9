"""Training-side attention. The towers' twin (samples.training.trainable_towers.band_attention):
the served reference's numbers forward, a plain per-segment softmax's gradients backward, on the
dense and on the chunked-band path, with and without sinks and GQA. The text model's
(samples.training.attention.text_attention): transformers' eager logits and gradients."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.band_attention_ref import band_attention_ref
from samples.training import trainable_towers
from samples.training.trainable_towers import band_attention


def _naive(q, k, v, cu, scale, window, sinks):
    """One segment at a time, every logit written out: the definition, with autograd."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu, cu[1:]):
        if b == a:
            continue
        qs, ks, vs = q[a:b], k[a:b].repeat_interleave(group, 1), v[a:b].repeat_interleave(group, 1)
        logits = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if window is not None:
            pos = torch.arange(b - a)
            logits = logits.masked_fill((pos[:, None] - pos[None, :]).abs() > window, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, b - a, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :b - a]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
    return torch.cat(outs)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 90), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0),
       window=st.one_of(st.none(), st.integers(1, 20)), with_sinks=st.booleans(),
       group=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_band_attention_matches_reference_forward_and_backward(lengths, window, with_sinks, group, seed):
    g = torch.Generator().manual_seed(seed)
    n, hkv, d = sum(lengths), 2, 8
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    q = torch.randn(n, hkv * group, d, generator=g, requires_grad=True)
    k = torch.randn(n, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(n, hkv, d, generator=g, requires_grad=True)
    sinks = torch.randn(hkv * group, generator=g, requires_grad=True) if with_sinks else None
    scale = d ** -0.5
    got = band_attention(q, k, v, torch.tensor(cu), scale=scale, window=window, sinks=sinks)
    with torch.no_grad():
        served = band_attention_ref(q, k, v, torch.tensor(cu), scale=scale, window=window, sinks=sinks)
    torch.testing.assert_close(got, served, rtol=1e-4, atol=1e-5)

    upstream = torch.randn(got.shape, generator=g)
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    want = _naive(q, k, v, cu, scale, window, sinks)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_band_path_is_taken_and_exact_on_a_long_segment(monkeypatch):
    """400 rows, window 16: the band is computed in 16-row chunks against 48 keys (not 400 x 400)."""
    shapes = []
    real = trainable_towers._sdpa
    monkeypatch.setattr(trainable_towers, "_sdpa", lambda q, k, *a: shapes.append((q.shape[:2], k.shape[:2])) or real(q, k, *a))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(400, 2, 8, generator=g) for _ in range(3))
    sinks = torch.randn(2, generator=g)
    cu = torch.tensor([0, 400])
    got = band_attention(q, k, v, cu, scale=0.3, window=16, sinks=sinks)
    torch.testing.assert_close(got, band_attention_ref(q, k, v, cu, scale=0.3, window=16, sinks=sinks),
                               rtol=1e-4, atol=1e-5)
    assert shapes == [((25, 16), (25, 48))]


def test_text_sdpa_sinks_attention_equals_eager_logits_and_gradients(monkeypatch):
    """The training text model's attention (SDPA + sink key; sliding layers on their band only)
    against transformers' eager path on a MiMo-V2-Flash layout with sinks, GQA, a sliding window
    shorter than the sequence and a right-padded batch: same logits, same gradients (sinks included)."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    from samples.training.attention import text_attention
    from samples.training.demo_model_config import DemoModelConfig
    from samples.training.attention.text_attention import SDPA_SINKS

    banded = []
    real = text_attention._banded
    monkeypatch.setattr(text_attention, "_banded", lambda *a: banded.append(real(*a)) or banded[-1])

    text = dict(DemoModelConfig().text, hidden_size=64, intermediate_size=96, head_dim=16, v_head_dim=16,
                sliding_window=8, moe_intermediate_size=32, vocab_size=97)
    models = []
    for impl in ("eager", SDPA_SINKS):
        torch.manual_seed(0)
        cfg = MiMoV2FlashConfig(**text, pad_token_id=0, bos_token_id=None)
        cfg._attn_implementation = impl
        m = MiMoV2FlashForCausalLM(cfg)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("sinks"):
                    p.copy_(torch.linspace(-2.0, 2.0, p.numel()))  # non-zero: the sink must count
        models.append(m)
    ids = torch.randint(1, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    ids[1, 25:] = 0
    outs = []
    for m in models:
        logits = m(input_ids=ids, use_cache=False).logits
        logits.square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert len(banded) == 3 and all(o is not None for o in banded)  # the 3 sliding layers took the band path
    assert ga.keys() == gb.keys() and any(n.endswith("sinks") for n in ga)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-3, atol=1e-5, msg=n)
