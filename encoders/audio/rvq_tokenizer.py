"""The MiMo-V2.5 audio tokenizer's encoder and its residual vector quantizer (docs/model.md §4).

    mel [T, n_mels] --conv1 (k3, pad 1) + GELU--> --conv2 (k3, stride 2, pad 1) + GELU--> [n1, d]   50 Hz
      --layers: pre-LN, rotary q/k, q/k/v/out biases; per layer causal and/or a left window
        (AudioTokenizerConfig.layer_attention); the output after ``encoder_skip_layer_id``
        layers is added to the last layer's output--> layer_norm
      --zero row if n1 is odd; Conv1d(d, d, k2, s2, no bias) + GELU + down_sample_norm--> [n2, d]  25 Hz
      --RVQ, fp32: per stage the nearest codebook row (argmin Euclidean distance), subtracted from
        the residual--> codes [n2, num_quantizers]

Every segment is encoded on its own (positions restart, no conv tap or attention crosses one), so
a batch of segments gives the rows each segment gives alone. Parameter names are the
``audio_tokenizer/model.safetensors`` ones under ``encoder.``.

A batch is packed, never padded to its longest segment: the encoder batcher budgets a batch by its
real mel frames, and one 60 s segment beside a hundred 1 s clips padded to [S, L] (with an
[S, 1, L, L] mask) cost ~25x that budget. As in our encoder (encoders/audio/packing.py):

    mel axis:     [seg0: T0][0][seg1: T1 ][0 0][seg2 ...   offsets % stride == 0, gaps >= kernel // 2
    transformer:  rows [n1_0 | n1_1 | ...] (cu_seqlens), rotary positions restart per segment
    downsample:   rows placed at offsets % avg_pooler == 0, a zero row after an odd segment

Attention runs per segment on the packed rows. Bidirectional layers (the sglang reading) use the
encoders' varlen kernel, kernels.ops.band_attention (±window). Causal layers, which that kernel does
not offer, run here (_causal_groups): short segments batched by padded length (is_causal, or one shared
[P, P] left-window mask), long windowed ones as query blocks with a key span of block + window --
so every temporary grows with the real frames (x window), none with segments x longest^2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.mimo_config import AudioTokenizerConfig
from encoders.rotary import apply_rotary, rotary_1d
from kernels import ops

# Query block of a long segment under a causal left window: queries q0 + [0, B) see the keys
# q0 - window + [0, B + window), so its temporaries are (B + window) per query row, not the segment.
_CAUSAL_BLOCK = 128
# Upper bound on the elements one attention call gathers (q, k, v of the width, plus the mask), as in
# kernels.band_attention_ref: many short segments run as a few calls, each of bounded size.
_CHUNK_BUDGET = 1 << 24


class TokenizerAttention(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads, self.head_dim = cfg.encoder_attention_heads, cfg.head_dim
        # the real k_proj may have no bias; the loader then fills zeros (docs/model.md §2.4)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(d, d, bias=True, device=device, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: "_AttentionPlan") -> torch.Tensor:
        """x [N, d] packed rows; cos/sin [N, head_dim]; ``plan``: which rows attend to which."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q = apply_rotary(self.q_proj(x).view(shape), cos, sin)
        k = apply_rotary(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        return self.out_proj(plan.attend(q, k, v, self.head_dim ** -0.5).reshape(x.shape[0], -1))


class TokenizerLayer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
        self.self_attn = TokenizerAttention(cfg, device=device, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim, device=device, dtype=dtype)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: "_AttentionPlan") -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cos, sin, plan)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class VectorQuantizerStage(nn.Module):
    """One RVQ stage: ``_codebook.embed`` [K, d] (the checkpoint's EMA buffers are not needed)."""

    def __init__(self, size: int, dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self._codebook = nn.Module()
        self._codebook.register_buffer("embed", torch.zeros(size, dim, device=device, dtype=dtype))


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(VectorQuantizerStage(k, cfg.d_model, device=device, dtype=dtype)
                                       for k in cfg.codebook_size)

    def codebooks(self) -> list[torch.Tensor]:
        """fp32 copies of bf16-rounded codebooks: the reference casts the tokenizer to bf16, then
        quantizes in fp32, so the distances it compares are to bf16 rows."""
        return [stage._codebook.embed.to(torch.bfloat16).float() for stage in self.vq.layers]

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> codes [N, num_quantizers] (int64), computed in fp32."""
        residual = x.float()
        codes = []
        for book in self.codebooks():
            book = book.to(residual.device)
            # |r - e|^2 = |r|^2 - 2 r.e + |e|^2; |r|^2 is the same for every e of a row
            dist = book.square().sum(-1)[None, :] - 2.0 * residual @ book.t()
            idx = dist.argmin(dim=-1)
            codes.append(idx)
            residual = residual - book[idx]
        return torch.stack(codes, dim=-1)


class AudioTokenizerEncoder(nn.Module):
    """``encoder.*`` of the audio tokenizer: log-mel segments -> 25 Hz features -> RVQ codes."""

    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        d, k = cfg.d_model, cfg.kernel_size
        self.conv1 = nn.Conv1d(cfg.n_mels, d, k, padding=k // 2, device=device, dtype=dtype)
        self.conv2 = nn.Conv1d(d, d, k, stride=cfg.stride_size, padding=k // 2, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TokenizerLayer(cfg, device=device, dtype=dtype) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps, device=device, dtype=dtype)
        self.down_sample_layer = nn.Sequential(
            nn.Conv1d(d, d, cfg.avg_pooler, stride=cfg.avg_pooler, bias=False, device=device, dtype=dtype), nn.GELU())
        self.down_sample_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps, device=device, dtype=dtype)
        self.quantizer = ResidualVectorQuantizer(cfg, device=device, dtype=dtype)

    def conv_frames(self, mel_frames: int) -> int:
        return (mel_frames - 1) // self.config.stride_size + 1

    @torch.no_grad()
    def features(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel segments [T_i, n_mels] -> 25 Hz features [ceil(n1_i / avg_pooler), d] each, in one
        packed forward (module doc): every tensor grows with the real frames of the batch."""
        if not segments:
            return []
        cfg = self.config
        dtype, device = self.conv1.weight.dtype, self.conv1.weight.device
        batch = _PackedSegments.build([int(s.shape[0]) for s in segments], cfg, device)
        mel = torch.zeros(cfg.n_mels, batch.mel_frames, dtype=dtype, device=device)
        for a, s in zip(batch.offsets, segments):
            mel[:, a:a + s.shape[0]] = s.t().to(device, dtype)
        # The gaps between segments are each conv's zero padding; GELU(bias) != 0 there after conv1,
        # so they are zeroed again before conv2 -- by masked_fill, not by multiplying with the mask:
        # NaN * 0 is NaN, and a gap must hold zeros whatever its neighbours hold.
        x = F.gelu(self.conv1(mel[None]))[0].masked_fill(~batch.gap_mask, 0.0)
        x = F.gelu(self.conv2(x[None]))[0].t()[batch.conv_index]  # [N, d]
        cos, sin = rotary_1d(batch.positions, cfg.head_dim, cfg.rope_theta)
        plans = {}
        skip = None
        for i, (layer, attn) in enumerate(zip(self.layers, cfg.layer_attention())):
            if attn not in plans:
                plans[attn] = _AttentionPlan.build(batch.n1, batch.cu_seqlens, *attn, width=cfg.d_model)
            x = layer(x, cos, sin, plans[attn])
            if cfg.encoder_skip_layer_id is not None and i + 1 == cfg.encoder_skip_layer_id:
                skip = x
        if skip is not None:
            x = x + skip
        # Downsample (k = s = avg_pooler, no padding): each segment starts at a multiple of
        # avg_pooler and the rows between stay zero, which is the zero row an odd segment gets alone.
        pooled = x.new_zeros(batch.pool_rows, x.shape[1]).index_copy_(0, batch.pool_index, self.layer_norm(x))
        x = self.down_sample_norm(self.down_sample_layer(pooled.t()[None])[0].t())
        return list(torch.split(x, batch.n2))

    @torch.no_grad()
    def tokenize(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel segments -> RVQ codes [n2_i, num_quantizers] each (one batched forward)."""
        feats = self.features(segments)
        codes = self.quantizer.encode(torch.cat(feats))
        return list(torch.split(codes, [f.shape[0] for f in feats]))


@dataclass(frozen=True)
class _PackedSegments:
    """Where each segment of a batch sits on the packed axes (module doc)."""

    offsets: tuple[int, ...]  # first mel frame of each segment (a multiple of the conv stride)
    mel_frames: int  # length of the packed mel axis
    gap_mask: torch.Tensor  # [mel_frames] bool, True inside a segment
    conv_index: torch.Tensor  # [N] conv2 output column of every transformer row
    positions: torch.Tensor  # [N] row position inside its segment (rotary)
    cu_seqlens: torch.Tensor  # [S + 1] int64 over transformer rows
    n1: tuple[int, ...]  # transformer rows per segment (50 Hz)
    n2: tuple[int, ...]  # downsampled rows per segment (25 Hz)
    pool_index: torch.Tensor  # [N] row of every transformer row on the downsample axis
    pool_rows: int  # length of the downsample axis (sum of n1 rounded up to avg_pooler)

    @classmethod
    def build(cls, lengths: list[int], cfg: AudioTokenizerConfig, device) -> "_PackedSegments":
        stride, pad, pool = cfg.stride_size, cfg.kernel_size // 2, cfg.avg_pooler
        offsets, cursor = [], 0
        for n in lengths:
            offsets.append(cursor)
            cursor = -(-(cursor + n + pad) // stride) * stride  # >= pad zero frames before the next
        mel_frames = offsets[-1] + lengths[-1]
        gap_mask = torch.zeros(mel_frames, dtype=torch.bool)
        n1 = [(n - 1) // stride + 1 for n in lengths]
        conv_index, positions, pool_index, base = [], [], [], 0
        for a, n, m in zip(offsets, lengths, n1):
            gap_mask[a:a + n] = True
            local = torch.arange(m)
            conv_index.append(a // stride + local)
            positions.append(local)
            pool_index.append(base + local)
            base += -(-m // pool) * pool
        cu = torch.tensor([0] + n1, dtype=torch.int64).cumsum(0)
        return cls(offsets=tuple(offsets), mel_frames=mel_frames, gap_mask=gap_mask.to(device),
                   conv_index=torch.cat(conv_index).to(device), positions=torch.cat(positions).to(device),
                   cu_seqlens=cu.to(device), n1=tuple(n1), n2=tuple(-(-m // pool) for m in n1),
                   pool_index=torch.cat(pool_index).to(device), pool_rows=base)


@dataclass(frozen=True)
class _Group:
    """``q_rows.shape[0]`` problems of ``block`` queries x ``span`` keys as packed row indices. A
    padding slot repeats a row of its own segment, so nothing (not even a NaN) of another segment
    is read; its output is dropped."""

    q_rows: torch.Tensor  # [n, block]
    k_rows: torch.Tensor  # [n, span]
    mask: torch.Tensor | None  # [1 or n, 1, block, span] bool, True = attend; None = is_causal
    keep: torch.Tensor | None  # positions of the real queries in the flat [n * block]; None = all
    out_rows: torch.Tensor  # [m] packed rows those queries write


@dataclass(frozen=True)
class _AttentionPlan:
    """One layer kind (causal, window) over the packed rows: each segment attends only within
    itself -- ``i - window <= j <= i`` (causal + window), ``j <= i`` (causal), ``|i - j| <= window``
    or the whole segment (bidirectional)."""

    causal: bool
    window: int | None
    cu_seqlens: torch.Tensor
    groups: tuple[_Group, ...]  # causal kinds only

    @classmethod
    def build(cls, n1: Sequence[int], cu_seqlens: torch.Tensor, causal: bool, window: int | None,
              width: int) -> "_AttentionPlan":
        groups = _causal_groups(list(n1), window, width, cu_seqlens.device) if causal else ()
        return cls(causal=causal, window=window, cu_seqlens=cu_seqlens, groups=tuple(groups))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q/k/v [N, H, D] -> [N, H, D]."""
        if not self.causal:
            return ops.band_attention(q, k, v, self.cu_seqlens, scale=scale, window=self.window)
        out = torch.empty_like(q)
        for g in self.groups:
            o = F.scaled_dot_product_attention(
                q[g.q_rows].transpose(1, 2), k[g.k_rows].transpose(1, 2), v[g.k_rows].transpose(1, 2),
                attn_mask=g.mask, is_causal=g.mask is None, scale=scale)
            o = o.transpose(1, 2).reshape(-1, *q.shape[1:])
            out[g.out_rows] = o if g.keep is None else o[g.keep]
        return out


def _padded_length(n: int) -> int:
    """Padded length of a short segment's bucket: up to 25% padding (four lengths per octave) so many
    clips of near lengths share one call; long segments keep their own length."""
    if n >= 256:
        return n
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _causal_groups(n1: list[int], window: int | None, width: int, device) -> list[_Group]:
    """Causal attention of every segment as batched problems of bounded size (module doc):

        dense (no window, or a segment <= block + window): the segment padded to its bucket length P;
            no window: is_causal (the fused kernels need no mask); window: one [P, P] mask for all
        banded (window, a longer segment): queries q0 + [0, B), keys q0 - window + [0, B + window)

    Under causality a real query never sees a padding key (all of them lie after it); a padding query
    always sees its own slot, so no softmax row is empty (a NaN row would be harmless -- dropped --
    but costs nothing to avoid)."""
    starts = [0]
    for n in n1:
        starts.append(starts[-1] + n)
    dense: dict[int, list[int]] = {}
    banded = []
    for s, n in enumerate(n1):
        if window is not None and n > _CAUSAL_BLOCK + window:
            banded += [(starts[s], n, q0) for q0 in range(0, n, _CAUSAL_BLOCK)]
        else:
            dense.setdefault(_padded_length(n), []).append(s)
    groups: list[_Group] = []
    for padded, segs in sorted(dense.items()):
        if len({n1[s] for s in segs}) == 1:
            padded = n1[segs[0]]  # one length: no padding needed to batch them
        local = torch.arange(padded, device=device)
        start = torch.tensor([starts[s] for s in segs], device=device)[:, None]
        length = torch.tensor([n1[s] for s in segs], device=device)[:, None]
        rows = start + torch.minimum(local[None], length - 1)
        mask = None if window is None else _left_window(local, local, window)[None, None]
        groups += _chunks(rows, rows, mask, local[None] < length, width)
    if banded:
        span = _CAUSAL_BLOCK + window
        start, length, q0 = (torch.tensor(c, device=device)[:, None] for c in zip(*banded))
        q_local = q0 + torch.arange(_CAUSAL_BLOCK, device=device)
        k_local = q0 - window + torch.arange(span, device=device)
        # the query/key offset is the same in every block: one band, and only the first blocks of a
        # segment have keys before its start to hide
        band = _left_window(torch.arange(_CAUSAL_BLOCK, device=device) + window, torch.arange(span, device=device),
                            window)
        mask = band[None, None] & (k_local >= 0)[:, None, None, :]
        groups += _chunks(start + torch.minimum(q_local, length - 1),
                          start + k_local.clamp(min=0).minimum(length - 1), mask, q_local < length, width)
    return groups


def _left_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: ``q - window <= k <= q``."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff <= window)


def _chunks(q_rows: torch.Tensor, k_rows: torch.Tensor, mask: torch.Tensor | None, valid: torch.Tensor,
            width: int) -> list[_Group]:
    """Problems cut into calls of at most ``_CHUNK_BUDGET`` gathered elements each."""
    block, span = q_rows.shape[1], k_rows.shape[1]
    step = max(1, _CHUNK_BUDGET // ((block + 2 * span) * width + block * span))
    out = []
    for c in range(0, q_rows.shape[0], step):
        q, ok = q_rows[c:c + step], valid[c:c + step].reshape(-1)
        m = mask if mask is None or mask.shape[0] == 1 else mask[c:c + step]
        every = bool(ok.all())
        keep = None if every else ok.nonzero().squeeze(1)
        out.append(_Group(q_rows=q, k_rows=k_rows[c:c + step], mask=m, keep=keep,
                          out_rows=q.reshape(-1) if every else q.reshape(-1)[keep]))
    return out
