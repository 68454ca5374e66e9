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
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.mimo_config import AudioTokenizerConfig
from encoders.rotary import apply_rotary, rotary_1d


class TokenizerAttention(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads, self.head_dim = cfg.encoder_attention_heads, cfg.head_dim
        # the real k_proj may have no bias; the loader then fills zeros (docs/model.md §2.4)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(d, d, bias=True, device=device, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [S, L, d]; cos/sin [L, head_dim]; mask [S, 1, L, L] bool (True = attend)."""
        s, n, _ = x.shape
        shape = (s * n, self.num_heads, self.head_dim)
        cos_f, sin_f = cos.repeat(s, 1), sin.repeat(s, 1)
        q = apply_rotary(self.q_proj(x).reshape(shape), cos_f, sin_f).view(s, n, self.num_heads, -1)
        k = apply_rotary(self.k_proj(x).reshape(shape), cos_f, sin_f).view(s, n, self.num_heads, -1)
        v = self.v_proj(x).view(s, n, self.num_heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(s, n, -1))


class TokenizerLayer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig, device=None, dtype=None) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
        self.self_attn = TokenizerAttention(cfg, device=device, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim, device=device, dtype=dtype)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cos, sin, mask)
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
        """Log-mel segments [T_i, n_mels] -> 25 Hz features [ceil(n1_i / avg_pooler), d] each."""
        cfg = self.config
        dtype, device = self.conv1.weight.dtype, self.conv1.weight.device
        lengths = [int(s.shape[0]) for s in segments]
        t_max = max(lengths)
        mel = torch.zeros(len(segments), cfg.n_mels, t_max, dtype=dtype, device=device)
        for i, s in enumerate(segments):
            mel[i, :, :s.shape[0]] = s.t().to(device, dtype)
        # Segments are right-padded with zeros: a conv tap past a segment's end reads zeros, which
        # is the conv's own zero padding for that segment alone; GELU(bias) != 0 in the padding
        # after conv1, so it is zeroed again before conv2 -- by masked_fill, not by multiplying with
        # the mask: NaN * 0 is NaN, and the pad must hold zeros whatever the segment holds.
        x = F.gelu(self.conv1(mel))
        frame = torch.arange(t_max, device=device)
        x = x.masked_fill((frame[None, :] >= torch.tensor(lengths, device=device)[:, None])[:, None, :], 0.0)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [S, L, d]
        n1 = torch.tensor([self.conv_frames(n) for n in lengths], device=device)
        length = x.shape[1]
        pos = torch.arange(length, device=device)
        valid = pos[None, :] < n1[:, None]  # [S, L]
        cos, sin = rotary_1d(pos, cfg.head_dim, cfg.rope_theta)
        masks = {}
        skip = None
        for i, (layer, attn) in enumerate(zip(self.layers, cfg.layer_attention())):
            if attn not in masks:
                masks[attn] = _mask(valid, *attn)
            x = layer(x, cos, sin, masks[attn])
            if cfg.encoder_skip_layer_id is not None and i + 1 == cfg.encoder_skip_layer_id:
                skip = x
        if skip is not None:
            x = x + skip
        x = self.layer_norm(x).masked_fill(~valid[..., None], 0.0)  # rows past a segment's end: the zero pad
        extra = -length % cfg.avg_pooler
        if extra:
            x = F.pad(x, (0, 0, 0, extra))
        x = self.down_sample_norm(self.down_sample_layer(x.transpose(1, 2)).transpose(1, 2))
        return [x[i, :-(-int(n) // cfg.avg_pooler)] for i, n in enumerate(n1.tolist())]

    @torch.no_grad()
    def tokenize(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel segments -> RVQ codes [n2_i, num_quantizers] each (one batched forward)."""
        feats = self.features(segments)
        codes = self.quantizer.encode(torch.cat(feats))
        return list(torch.split(codes, [f.shape[0] for f in feats]))


def _mask(valid: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """[S, 1, L, L] bool: keys inside the segment, and ``i - window <= j <= i`` (causal + window),
    ``j <= i`` (causal) or ``|i - j| <= window`` (window only) per the layer's kind."""
    length = valid.shape[1]
    i = torch.arange(length, device=valid.device)
    diff = i[:, None] - i[None, :]
    allowed = torch.ones(length, length, dtype=torch.bool, device=valid.device)
    if causal:
        allowed &= diff >= 0
    if window is not None:
        allowed &= diff <= window
        if not causal:
            allowed &= -diff <= window
    mask = allowed[None] & valid[:, None, :]
    # a padding query attends to itself only: a row with no allowed key would be NaN, and NaN
    # times a zero attention weight still poisons the valid rows of the next layer
    mask |= torch.eye(length, dtype=torch.bool, device=valid.device)[None] & ~valid[:, :, None]
    return mask[:, None]
