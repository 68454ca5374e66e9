"""Configs of the MiMo-V2.5 reference audio path (docs/model.md §1.3, §1.6, §4).

Two files describe it:

    audio_tokenizer/config.json   -> AudioTokenizerConfig  (conv stack, transformer, downsample, RVQ)
    config.json "audio_config"    -> SpeechInputConfig     (speech embeddings, input local
                                                            transformer, projection)

The log-mel front end, the segment size and the token count per segment stay with
``encoders.config.AudioConfig`` (the one token-count rule, ``unit_tokens``): the reference
downsample conv (k = s = avg_pooler, odd lengths zero-padded) makes exactly ``ceil(n1 / avg_pooler)``
rows, as our average pool does, so one rule counts both paths.

Open point of the model family (docs/model.md §4, "UNCERTAIN"): how the tokenizer's layers attend.
``tokenizer_attention="reference"`` (default) follows the reference modelling code: every layer is
causal, and the sliding layers (``i % swa_per_block < swa_per_block - 1``) see only the
``window`` previous frames (FlashAttention window ``(window, 0)``: keys ``i - window .. i``).
``"bidirectional"`` is sglang's reading: every layer full and bidirectional. Both are pinned by tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOKENIZER_ATTENTION = ("reference", "bidirectional")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _int_list(value: Any, n: int, name: str) -> tuple[int, ...]:
    """A per-channel size: a list, a dash-separated string (``"1025-1025-129"``), or one number for
    all channels (the hub writes ``"1280"``, a string)."""
    if isinstance(value, (list, tuple)):
        out = tuple(int(v) for v in value)
    elif isinstance(value, str) and "-" in value:
        out = tuple(int(v) for v in value.split("-"))
    else:
        out = (int(value),) * n
    _require(len(out) == n, f"{name} has {len(out)} entries for {n} channels")
    return out


@dataclass(frozen=True)
class AudioTokenizerConfig:
    """``audio_tokenizer/config.json``: the frozen encoder that turns log-mel into RVQ codes."""

    n_mels: int = 128
    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    encoder_skip_layer_id: int | None = 3  # the output after this many layers is added to the last
    encoder_causal: bool = True
    window: int = 128  # left window of the sliding layers (encoder_attn_window_size[0])
    hybrid_attention: bool = True
    swa_per_block: int = 2
    kernel_size: int = 3
    stride_size: int = 2
    avg_pooler: int = 2
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    codebook_size: tuple[int, ...] = (1024, 1024, 256) + (128,) * 17
    tokenizer_attention: str = "reference"  # see module doc

    def __post_init__(self) -> None:
        for name in ("n_mels", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                     "kernel_size", "stride_size", "avg_pooler", "swa_per_block"):
            _require(getattr(self, name) > 0, f"audio_tokenizer.{name} must be positive, got {getattr(self, name)}")
        _require(self.d_model % self.encoder_attention_heads == 0,
                 f"audio_tokenizer: d_model {self.d_model} not divisible by {self.encoder_attention_heads} heads")
        _require(self.head_dim % 2 == 0, f"audio_tokenizer: head_dim {self.head_dim} must be even (rotary)")
        _require(self.kernel_size % 2 == 1, f"audio_tokenizer: kernel_size {self.kernel_size} must be odd")
        _require(self.window >= 0, "audio_tokenizer: the attention window must be >= 0")
        _require(len(self.codebook_size) > 0 and min(self.codebook_size) > 0,
                 f"audio_tokenizer: codebook_size {self.codebook_size} needs positive sizes")
        skip = self.encoder_skip_layer_id
        _require(skip is None or 0 < skip <= self.encoder_layers,
                 f"audio_tokenizer: encoder_skip_layer_id {skip} outside 1..{self.encoder_layers}")
        _require(self.tokenizer_attention in TOKENIZER_ATTENTION,
                 f"tokenizer_attention {self.tokenizer_attention!r} is not one of {TOKENIZER_ATTENTION}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def num_quantizers(self) -> int:
        return len(self.codebook_size)

    def layer_attention(self) -> tuple[tuple[bool, int | None], ...]:
        """Per layer (causal, left window or None for no window) under ``tokenizer_attention``."""
        if self.tokenizer_attention == "bidirectional":
            return ((False, None),) * self.encoder_layers
        out = []
        for i in range(self.encoder_layers):
            sliding = self.hybrid_attention and i % self.swa_per_block < self.swa_per_block - 1
            out.append((self.encoder_causal, self.window if sliding else None))
        return tuple(out)

    @classmethod
    def from_dict(cls, d: dict[str, Any], tokenizer_attention: str = "reference") -> "AudioTokenizerConfig":
        window = d.get("encoder_attn_window_size", [cls.window, 0])
        left = int(window[0]) if isinstance(window, (list, tuple)) else int(window)
        sizes = d.get("codebook_size", list(cls.codebook_size))
        nq = int(d.get("num_quantizers", len(sizes) if isinstance(sizes, (list, tuple)) else 20))
        skip = d.get("encoder_skip_layer_id", cls.encoder_skip_layer_id)
        return cls(
            n_mels=int(d.get("n_mels", cls.n_mels)), d_model=int(d.get("d_model", cls.d_model)),
            encoder_layers=int(d.get("encoder_layers", cls.encoder_layers)),
            encoder_attention_heads=int(d.get("encoder_attention_heads", cls.encoder_attention_heads)),
            encoder_ffn_dim=int(d.get("encoder_ffn_dim", cls.encoder_ffn_dim)),
            encoder_skip_layer_id=None if skip is None else int(skip),
            encoder_causal=bool(d.get("encoder_causal", cls.encoder_causal)),
            window=max(left, 0) if left >= 0 else 0,
            hybrid_attention=bool(d.get("hybrid_attention", cls.hybrid_attention)) and left >= 0,
            swa_per_block=int(d.get("swa_per_block", cls.swa_per_block)),
            kernel_size=int(d.get("kernel_size", cls.kernel_size)), stride_size=int(d.get("stride_size", cls.stride_size)),
            avg_pooler=int(d.get("avg_pooler", cls.avg_pooler)), rope_theta=float(d.get("rope_theta", cls.rope_theta)),
            layer_norm_eps=float(d.get("layer_norm_eps", cls.layer_norm_eps)),
            codebook_size=_int_list(sizes, nq, "codebook_size"),
            tokenizer_attention=tokenizer_attention,
        )

    def to_dict(self) -> dict[str, Any]:
        """``audio_tokenizer/config.json`` spelling (inverse of :meth:`from_dict`)."""
        return {
            "n_mels": self.n_mels, "d_model": self.d_model, "encoder_layers": self.encoder_layers,
            "encoder_attention_heads": self.encoder_attention_heads, "encoder_ffn_dim": self.encoder_ffn_dim,
            "encoder_skip_layer_id": self.encoder_skip_layer_id, "encoder_causal": self.encoder_causal,
            "encoder_attn_window_size": [self.window, 0], "hybrid_attention": self.hybrid_attention,
            "swa_per_block": self.swa_per_block, "kernel_size": self.kernel_size, "stride_size": self.stride_size,
            "avg_pooler": self.avg_pooler, "rope_theta": self.rope_theta, "position_embedding_type": "rope",
            "ln_type": "LayerNorm", "activation_function": "gelu", "scale_embedding": False,
            "num_quantizers": self.num_quantizers, "codebook_size": list(self.codebook_size),
        }


@dataclass(frozen=True)
class SpeechInputConfig:
    """The main checkpoint's ``audio_config``: codes -> one LLM embedding per group of codes."""

    audio_channels: int = 20
    group_size: int = 4
    speech_vocab_size: tuple[int, ...] = field(default=(1280,) * 20)
    input_local_dim: int = 1024
    input_local_layers: int = 6
    input_local_attn_heads: int = 16
    input_local_head_dim: int = 64
    input_local_intermediate_size: int = 4096
    input_full_attention: bool = True  # bidirectional inside a group (is_causal = not this)
    add_post_norm: bool = True
    rope_theta: float = 640000.0
    rms_norm_eps: float = 1e-6
    projection_hidden_size: int = 16384
    out_hidden_size: int = 4096

    def __post_init__(self) -> None:
        for name in ("audio_channels", "group_size", "input_local_dim", "input_local_layers",
                     "input_local_attn_heads", "input_local_head_dim", "input_local_intermediate_size",
                     "projection_hidden_size", "out_hidden_size"):
            _require(getattr(self, name) > 0, f"audio_config.{name} must be positive, got {getattr(self, name)}")
        _require(len(self.speech_vocab_size) == self.audio_channels,
                 f"audio_config: {len(self.speech_vocab_size)} speech vocab sizes for {self.audio_channels} channels")
        _require(self.input_local_head_dim % 2 == 0, "audio_config: input_local_head_dim must be even (rotary)")

    @staticmethod
    def is_reference(audio_config: dict[str, Any]) -> bool:
        """Does a checkpoint's ``audio_config`` describe the reference path (vs our encoder)?"""
        return "input_local_layers" in audio_config or "speech_vocab_size" in audio_config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeechInputConfig":
        channels = int(d.get("audio_channels", cls.audio_channels))
        out_hidden = int(d.get("out_hidden_size", cls.out_hidden_size))
        group = int(d.get("group_size", cls.group_size))
        dim = int(d.get("input_local_dim", cls.input_local_dim))
        return cls(
            audio_channels=channels, group_size=group,
            speech_vocab_size=_int_list(d.get("speech_vocab_size", 1280), channels, "speech_vocab_size"),
            input_local_dim=dim, input_local_layers=int(d.get("input_local_layers", cls.input_local_layers)),
            input_local_attn_heads=int(d.get("input_local_attn_heads", cls.input_local_attn_heads)),
            input_local_head_dim=int(d.get("input_local_head_dim", cls.input_local_head_dim)),
            input_local_intermediate_size=int(d.get("input_local_intermediate_size",
                                                    cls.input_local_intermediate_size)),
            input_full_attention=bool(d.get("input_full_attention", cls.input_full_attention)),
            add_post_norm=bool(d.get("add_post_norm", cls.add_post_norm)),
            rope_theta=float(d.get("rope_theta", cls.rope_theta)),
            rms_norm_eps=float(d.get("rms_norm_eps", cls.rms_norm_eps)),
            # the hub config has no field for it; the real tensor is [4 * 4096, group * dim]
            projection_hidden_size=int(d.get("projection_hidden_size", 4 * out_hidden)),
            out_hidden_size=out_hidden,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "audio_channels": self.audio_channels, "group_size": self.group_size,
            "speech_vocab_size": list(self.speech_vocab_size), "input_local_dim": self.input_local_dim,
            "input_local_layers": self.input_local_layers, "input_local_attn_heads": self.input_local_attn_heads,
            "input_local_head_dim": self.input_local_head_dim,
            "input_local_intermediate_size": self.input_local_intermediate_size,
            "input_full_attention": self.input_full_attention, "add_post_norm": self.add_post_norm,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "projection_hidden_size": self.projection_hidden_size, "out_hidden_size": self.out_hidden_size,
            "partial_rotary_factor": 1.0, "projection_layers": 2,
        }
