"""The MiMo-V2.5 audio tokenizer encoder runs a batch packed, not padded to its longest segment.

The encoder batcher budgets an audio batch by its real mel frames; the tokenizer used to right-pad
every segment to the longest one and build a dense [S, 1, L, L] mask, so one 60 s segment beside
a hundred short clips cost ~25x the budget (5.5 GiB of live tensors at the tiny widths). Here:

* the packed forward gives what the old padded one gave (a copy of it below is the reference), for
  both attention readings, a symmetric window, and segments long enough for the banded blocks;
* the memory of one forward adds up over its segments (live tensor bytes tracked op by op), where
  the padded one grew with segments x longest^2;
* a segment holding NaN spoils no other segment of its batch.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from encoders.audio.rvq_tokenizer import AudioTokenizerEncoder
from encoders.rotary import apply_rotary, rotary_1d
from samples.checkpoints.tiny_towers import init_random_, tiny_tokenizer_config

pytestmark = pytest.mark.usefixtures("one_thread")


def tokenizer(seed: int = 0, **over) -> AudioTokenizerEncoder:
    return init_random_(AudioTokenizerEncoder(tiny_tokenizer_config(**over)), seed).eval()


def mels(lengths, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 32, generator=g) for n in lengths]


# ---- the old padded forward, kept as the reference ----------------------------------------------
def _padded_mask(valid: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    length = valid.shape[1]
    i = torch.arange(length)
    diff = i[:, None] - i[None, :]
    allowed = torch.ones(length, length, dtype=torch.bool)
    if causal:
        allowed &= diff >= 0
    if window is not None:
        allowed &= diff <= window
        if not causal:
            allowed &= -diff <= window
    mask = allowed[None] & valid[:, None, :]
    mask |= torch.eye(length, dtype=torch.bool)[None] & ~valid[:, :, None]
    return mask[:, None]


@torch.no_grad()
def padded_features(enc: AudioTokenizerEncoder, segments: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tokenizer's forward before packing: [S, L] right-padded, a dense [S, 1, L, L] mask."""
    cfg = enc.config
    lengths = [int(s.shape[0]) for s in segments]
    t_max = max(lengths)
    mel = torch.zeros(len(segments), cfg.n_mels, t_max)
    for i, s in enumerate(segments):
        mel[i, :, :s.shape[0]] = s.t()
    x = F.gelu(enc.conv1(mel))
    x = x.masked_fill((torch.arange(t_max)[None, :] >= torch.tensor(lengths)[:, None])[:, None, :], 0.0)
    x = F.gelu(enc.conv2(x)).transpose(1, 2)
    n1 = torch.tensor([enc.conv_frames(n) for n in lengths])
    s, length = x.shape[0], x.shape[1]
    pos = torch.arange(length)
    valid = pos[None, :] < n1[:, None]
    cos, sin = rotary_1d(pos, cfg.head_dim, cfg.rope_theta)
    cos_f, sin_f = cos.repeat(s, 1), sin.repeat(s, 1)
    skip = None
    for i, (layer, attn) in enumerate(zip(enc.layers, cfg.layer_attention())):
        mask = _padded_mask(valid, *attn)
        a, h = layer.self_attn, layer.self_attn_layer_norm(x)
        shape = (s * length, a.num_heads, a.head_dim)
        q = apply_rotary(a.q_proj(h).reshape(shape), cos_f, sin_f).view(s, length, a.num_heads, -1)
        k = apply_rotary(a.k_proj(h).reshape(shape), cos_f, sin_f).view(s, length, a.num_heads, -1)
        v = a.v_proj(h).view(s, length, a.num_heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + a.out_proj(out.transpose(1, 2).reshape(s, length, -1))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        if cfg.encoder_skip_layer_id is not None and i + 1 == cfg.encoder_skip_layer_id:
            skip = x
    if skip is not None:
        x = x + skip
    x = enc.layer_norm(x).masked_fill(~valid[..., None], 0.0)
    if length % cfg.avg_pooler:
        x = F.pad(x, (0, 0, 0, cfg.avg_pooler - length % cfg.avg_pooler))
    x = enc.down_sample_norm(enc.down_sample_layer(x.transpose(1, 2)).transpose(1, 2))
    return [x[i, :-(-int(n) // cfg.avg_pooler)] for i, n in enumerate(n1.tolist())]


# short, odd, equal and unequal lengths; 300+ mel frames -> 150+ rows, over block + window (3): banded
LENGTHS = [37, 16, 5, 1, 2, 3, 37, 300, 301, 96, 7, 531]


@pytest.mark.parametrize("over", [
    dict(tokenizer_attention="reference"),  # causal; left window 3, then full causal
    dict(tokenizer_attention="bidirectional"),  # full, both ways
    dict(encoder_causal=False),  # symmetric window +-3, then full
    dict(window=40, encoder_skip_layer_id=None),  # a window wider than some segments
    dict(window=0),  # each row sees itself only on the sliding layers
], ids=["reference", "bidirectional", "symmetric-window", "window-40", "window-0"])
def test_packed_forward_matches_the_padded_one_and_each_segment_alone(over):
    enc = tokenizer(**over)
    segs = mels(LENGTHS)
    got = enc.features(segs)
    want = padded_features(enc, segs)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w, s in zip(got, want, segs):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(enc.features([s])[0], g, atol=2e-5, rtol=1e-4)
    for codes, s in zip(enc.tokenize(segs), segs):
        assert torch.equal(codes, enc.tokenize([s])[0])
    assert enc.features([]) == []


# ---- memory -------------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that torch ops allocate while active and that are still referenced
    (every op output is counted once per storage and released when its last tensor dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [tensors alive, bytes]
        self._seen: dict[int, weakref.ref] = {}

    def _release(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ref = self._seen.get(id(t))
            if ref is not None and ref() is t:  # an in-place op hands back a tensor already counted
                continue
            self._seen[id(t)] = weakref.ref(t)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._storages:
                self._storages[ptr] = [0, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._storages[ptr][0] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def peak_bytes(enc: AudioTokenizerEncoder, segs: list[torch.Tensor]) -> int:
    with LiveBytes() as tracker:
        enc.features(segs)
    return tracker.peak


def test_memory_of_a_batch_adds_up_over_its_segments():
    """One long segment (600 rows) and 80 short clips (10 rows each): the padded forward held
    ~224 MiB (81 x 600^2 mask, as bool and as float) against ~6 MiB for its parts run apart; packed,
    the batch costs no more than its parts -- memory follows the real frames."""
    enc = tokenizer()
    long, short = mels([1200]), mels([20] * 80, seed=1)
    parts = peak_bytes(enc, long) + peak_bytes(enc, short)
    batch = peak_bytes(enc, long + short)
    assert batch <= 1.25 * parts, (batch, parts)
    # and 40 more clips add about their own share, not 40 x 600^2
    fewer = peak_bytes(enc, long + short[:40])
    assert batch - fewer <= peak_bytes(enc, short[:40]), (batch, fewer)


def test_the_padded_reference_fails_the_memory_check():
    """The check above catches the padded forward (so it measures what it says)."""
    enc = tokenizer()
    long, short = mels([1200]), mels([20] * 40, seed=1)

    class Padded(AudioTokenizerEncoder):
        def features(self, segments):
            return padded_features(self, list(segments))

    padded = Padded(enc.config).eval()
    padded.load_state_dict(enc.state_dict())
    assert peak_bytes(padded, long + short) > 10 * (peak_bytes(padded, long) + peak_bytes(padded, short))


# ---- non-finite input ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["reference", "bidirectional"])
def test_a_nan_segment_spoils_no_other_segment(mode):
    enc = tokenizer(tokenizer_attention=mode)
    segs = mels([37, 300, 40, 5, 301])
    bad = segs[2].clone()
    bad[3, 7] = float("nan")
    bad[30, 0] = float("inf")
    batch = segs[:2] + [bad] + segs[3:]
    got = enc.features(batch)
    assert not torch.isfinite(got[2]).all()
    for i in (0, 1, 3, 4):
        assert torch.isfinite(got[i]).all()
        torch.testing.assert_close(got[i], enc.features([segs[i]])[0], atol=2e-5, rtol=1e-4)
