"""Encoder configs: the vision tower (hub ``vision_config``) and our audio encoder, and
:func:`unit_tokens`, the one rule for how many LLM tokens a media item becomes.

Both configs are frozen; ``from_dict`` normalises a checkpoint's dict once and validates it, so model
code never re-derives or second-guesses a field. The per-block attention layout is data
(``VisionConfig.block_kinds`` / ``AudioConfig.layer_types``), never index arithmetic in model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

# vit_window_attn_types codes of the hub config -> our block kinds.
_VISION_KIND_BY_CODE = {-1: "full", 0: "row", 1: "col"}
AUDIO_LAYER_TYPES = ("full", "sliding")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class VisionConfig:
    """MiMo-V2.5 ViT geometry (docs/model.md §1.2, §3). ``window`` is the symmetric band half-width
    in patch tokens (``visual_token_window_size``): a windowed block sees ``|i - j| <= window``."""

    depth: int = 28
    hidden_size: int = 1280
    intermediate_size: int = 4608
    num_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    in_chans: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    fullatt_block_indexes: tuple[int, ...] = (0, 9, 18, 27)
    vit_window_attn_types: tuple[int, ...] = (
        -1, 0, 0, 0, 0, 1, 1, 1, 1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -1)
    window: int = 64
    use_sink: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "num_key_value_heads",
                     "head_dim", "in_chans", "patch_size", "temporal_patch_size", "spatial_merge_size",
                     "out_hidden_size"):
            _require(getattr(self, name) > 0, f"vision_config.{name} must be positive, got {getattr(self, name)}")
        _require(self.num_heads % self.num_key_value_heads == 0,
                 f"vision_config: num_heads {self.num_heads} is not divisible by "
                 f"num_key_value_heads {self.num_key_value_heads}")
        _require(self.head_dim % 4 == 0,
                 f"vision_config: head_dim {self.head_dim} must be a multiple of 4 (2-D rotary: h and w halves)")
        _require(len(self.vit_window_attn_types) == self.depth,
                 f"vision_config: vit_window_attn_types has {len(self.vit_window_attn_types)} entries for "
                 f"depth {self.depth}")
        unknown = sorted({t for t in self.vit_window_attn_types if t not in _VISION_KIND_BY_CODE})
        _require(not unknown, f"vision_config: unknown attention type(s) {unknown} in vit_window_attn_types "
                              f"(expected -1 full, 0 row window, 1 column window)")
        bad = [b for b in self.fullatt_block_indexes if not 0 <= b < self.depth]
        _require(not bad, f"vision_config: fullatt_block_indexes {bad} outside [0, {self.depth})")
        full_by_type = {i for i, t in enumerate(self.vit_window_attn_types) if t == -1}
        _require(full_by_type == set(self.fullatt_block_indexes),
                 f"vision_config: fullatt_block_indexes {sorted(self.fullatt_block_indexes)} disagree with the "
                 f"-1 entries of vit_window_attn_types {sorted(full_by_type)}")
        _require(self.window >= 0, f"vision_config: visual_token_window_size must be >= 0, got {self.window}")
        _require(self.hidden_act == "silu", f"vision_config: hidden_act {self.hidden_act!r} unsupported (silu)")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def block_kinds(self) -> tuple[str, ...]:
        """Per block: "full" (whole frame), "row" / "col" (±window band in row / column unit order)."""
        return tuple(_VISION_KIND_BY_CODE[t] for t in self.vit_window_attn_types)

    @property
    def patch_dim(self) -> int:
        """Length of one patch row: C * temporal_patch * patch * patch (Conv3d weight flatten order)."""
        return self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patch tokens per merged output token (spatial_merge_size ** 2)."""
        return self.spatial_merge_size ** 2

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim

    def has_sinks(self, block: int) -> bool:
        """Sinks live on windowed blocks only (checkpoint: no ``attn.sinks`` on full blocks)."""
        return self.use_sink and self.block_kinds[block] != "full"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        """From a hub ``vision_config`` dict. Absent ``qk_channels`` -> head_dim 64 (sglang default);
        absent ``vit_window_attn_types`` -> row windows everywhere except the full blocks."""
        depth = int(d.get("depth", cls.depth))
        full = tuple(int(b) for b in d.get("fullatt_block_indexes", cls.fullatt_block_indexes))
        types = d.get("vit_window_attn_types")
        if types is None:
            types = [-1 if b in full else 0 for b in range(depth)]
        patch = int(d.get("spatial_patch_size", d.get("patch_size", cls.patch_size)))
        return cls(
            depth=depth,
            hidden_size=int(d.get("hidden_size", cls.hidden_size)),
            intermediate_size=int(d.get("intermediate_size", cls.intermediate_size)),
            num_heads=int(d.get("num_heads", cls.num_heads)),
            num_key_value_heads=int(d.get("num_key_value_heads", d.get("num_heads", cls.num_key_value_heads))),
            head_dim=int(d.get("qk_channels", d.get("head_dim", cls.head_dim))),
            in_chans=int(d.get("in_chans", cls.in_chans)),
            patch_size=patch,
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            spatial_merge_size=int(d.get("spatial_merge_size", cls.spatial_merge_size)),
            out_hidden_size=int(d.get("out_hidden_size", cls.out_hidden_size)),
            fullatt_block_indexes=full,
            vit_window_attn_types=tuple(int(t) for t in types),
            window=int(d.get("visual_token_window_size", cls.window)),
            use_sink=bool(d.get("use_sink", cls.use_sink)),
            hidden_act=str(d.get("hidden_act", cls.hidden_act)),
            rms_norm_eps=float(d.get("rms_norm_eps", cls.rms_norm_eps)),
            rope_theta=float(d.get("rope_theta", cls.rope_theta)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Hub spelling (inverse of :meth:`from_dict`)."""
        return {
            "depth": self.depth, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads, "num_key_value_heads": self.num_key_value_heads,
            "qk_channels": self.head_dim, "kv_channels": self.head_dim, "in_chans": self.in_chans,
            "patch_size": self.patch_size, "spatial_patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size, "spatial_merge_size": self.spatial_merge_size,
            "out_hidden_size": self.out_hidden_size, "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "vit_window_attn_types": list(self.vit_window_attn_types),
            "visual_token_window_size": self.window, "use_sink": self.use_sink, "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
        }


@dataclass(frozen=True)
class AudioConfig:
    """Our audio encoder: log-mel -> conv (k3, then k3 stride 2) -> transformer (per-layer "full" or
    "sliding" ±window band, bidirectional) -> avg pool -> groups of ``group_size`` -> projection MLP.

    Token count per segment of T mel frames (docs/model.md §4):
        n1 = (T - 1) // stride + 1;  n2 = ceil(n1 / avg_pooler);  tokens = ceil(n2 / group_size)
    """

    sampling_rate: int = 24000
    n_fft: int = 960
    window_size: int = 960
    hop_length: int = 240
    n_mels: int = 128
    fmin: float = 0.0
    fmax: float | None = None
    kernel_size: int = 3
    stride_size: int = 2
    d_model: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    ffn_dim: int = 4096
    layer_types: tuple[str, ...] = field(default=("sliding", "full") * 12)
    attention_window: int = 128
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    avg_pooler: int = 2
    group_size: int = 4
    segment_size: int = 6000
    projection_hidden_size: int = 16384
    out_hidden_size: int = 4096

    def __post_init__(self) -> None:
        for name in ("sampling_rate", "n_fft", "window_size", "hop_length", "n_mels", "kernel_size",
                     "stride_size", "d_model", "num_layers", "num_heads", "ffn_dim", "avg_pooler",
                     "group_size", "segment_size", "projection_hidden_size", "out_hidden_size"):
            _require(getattr(self, name) > 0, f"audio_config.{name} must be positive, got {getattr(self, name)}")
        _require(self.d_model % self.num_heads == 0,
                 f"audio_config: d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        _require(self.head_dim % 2 == 0, f"audio_config: head_dim {self.head_dim} must be even (rotary)")
        _require(len(self.layer_types) == self.num_layers,
                 f"audio_config: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted({t for t in self.layer_types if t not in AUDIO_LAYER_TYPES})
        _require(not unknown, f"audio_config: unknown attention type(s) {unknown} (expected {AUDIO_LAYER_TYPES})")
        _require(self.kernel_size % 2 == 1, f"audio_config: kernel_size {self.kernel_size} must be odd")
        _require(self.attention_window >= 0, "audio_config: attention_window must be >= 0")
        _require(self.window_size <= self.n_fft, f"audio_config: window_size {self.window_size} > n_fft {self.n_fft}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def frames_per_second(self) -> float:
        return self.sampling_rate / self.hop_length

    @property
    def tokens_per_second(self) -> float:
        """LLM tokens per second of sound (6.25 for MiMo-V2.5: 100 mel frames/s, stride 2, pool 2,
        group 4); lays a video's sound out by time (docs/model.md §5.3)."""
        return self.code_frames_per_second / self.group_size

    def num_mel_frames(self, num_samples: int) -> int:
        """Mel frames of a centred STFT over ``num_samples`` samples."""
        return 1 + num_samples // self.hop_length

    def conv_frames(self, mel_frames: int) -> int:
        return (mel_frames - 1) // self.stride_size + 1

    def code_frames(self, mel_frames: int) -> int:
        """Rows after the pool (the reference path's RVQ code frames, 25 per second) of a segment."""
        return -(-self.conv_frames(mel_frames) // self.avg_pooler)

    @property
    def codes_per_segment(self) -> int:
        """Code frames of one whole ``segment_size`` segment: pre-tokenized codes are cut here, so
        their segments are the ones the tokenizer made from the audio (1500 for MiMo-V2.5)."""
        return self.code_frames(self.segment_size)

    @property
    def code_frames_per_second(self) -> float:
        return self.frames_per_second / (self.stride_size * self.avg_pooler)

    def segment_tokens(self, mel_frames: int) -> int:
        """Output tokens of one segment of ``mel_frames`` (<= segment_size) frames."""
        if mel_frames <= 0:
            raise ValueError(f"an audio segment needs at least one mel frame, got {mel_frames}")
        return self.code_tokens(self.code_frames(mel_frames))

    def code_tokens(self, code_frames: int) -> int:
        """Output tokens of one segment of ``code_frames`` (<= codes_per_segment) pooled rows or codes."""
        if code_frames <= 0:
            raise ValueError(f"an audio segment needs at least one code frame, got {code_frames}")
        return -(-code_frames // self.group_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AudioConfig":
        """From our ``audio_config`` dict; the processor-style names (``audio_nfft``, ``audio_n_mels``...)
        and the tokenizer-style names (``encoder_layers``, ``swa_per_block``...) are accepted too."""

        def pick(*names, default):
            for n in names:
                if n in d and d[n] is not None:
                    return d[n]
            return default

        num_layers = int(pick("num_layers", "encoder_layers", default=cls.num_layers))
        types = pick("layer_types", default=None)
        if types is None:
            per_block = pick("swa_per_block", default=None)
            if per_block is None:
                types = cls.layer_types if num_layers == len(cls.layer_types) else ("full",) * num_layers
            else:
                # Tokenizer rule: layer i slides iff i % swa_per_block < swa_per_block - 1.
                per_block = int(per_block)
                types = tuple("sliding" if i % per_block < per_block - 1 else "full" for i in range(num_layers))
        fmax = pick("fmax", "audio_fmax", default=None)
        return cls(
            sampling_rate=int(pick("sampling_rate", "audio_sampling_rate", default=cls.sampling_rate)),
            n_fft=int(pick("n_fft", "nfft", "audio_nfft", default=cls.n_fft)),
            window_size=int(pick("window_size", "audio_window_size", default=cls.window_size)),
            hop_length=int(pick("hop_length", "audio_hop_length", default=cls.hop_length)),
            n_mels=int(pick("n_mels", "audio_n_mels", default=cls.n_mels)),
            fmin=float(pick("fmin", "audio_fmin", default=cls.fmin)),
            fmax=None if fmax is None else float(fmax),
            kernel_size=int(pick("kernel_size", "audio_kernel_size", default=cls.kernel_size)),
            stride_size=int(pick("stride_size", "audio_stride_size", default=cls.stride_size)),
            d_model=int(pick("d_model", default=cls.d_model)),
            num_layers=num_layers,
            num_heads=int(pick("num_heads", "encoder_attention_heads", default=cls.num_heads)),
            ffn_dim=int(pick("ffn_dim", "encoder_ffn_dim", default=cls.ffn_dim)),
            layer_types=tuple(str(t) for t in types),
            attention_window=int(pick("attention_window", default=cls.attention_window)),
            rope_theta=float(pick("rope_theta", default=cls.rope_theta)),
            layer_norm_eps=float(pick("layer_norm_eps", default=cls.layer_norm_eps)),
            avg_pooler=int(pick("avg_pooler", "audio_avg_pooler", default=cls.avg_pooler)),
            group_size=int(pick("group_size", "audio_group_size", default=cls.group_size)),
            segment_size=int(pick("segment_size", "audio_segment_size", default=cls.segment_size)),
            projection_hidden_size=int(pick("projection_hidden_size", default=cls.projection_hidden_size)),
            out_hidden_size=int(pick("out_hidden_size", default=cls.out_hidden_size)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampling_rate": self.sampling_rate, "n_fft": self.n_fft, "window_size": self.window_size,
            "hop_length": self.hop_length, "n_mels": self.n_mels, "fmin": self.fmin, "fmax": self.fmax,
            "kernel_size": self.kernel_size, "stride_size": self.stride_size, "d_model": self.d_model,
            "num_layers": self.num_layers, "num_heads": self.num_heads, "ffn_dim": self.ffn_dim,
            "layer_types": list(self.layer_types), "attention_window": self.attention_window,
            "rope_theta": self.rope_theta, "layer_norm_eps": self.layer_norm_eps,
            "avg_pooler": self.avg_pooler, "group_size": self.group_size, "segment_size": self.segment_size,
            "projection_hidden_size": self.projection_hidden_size, "out_hidden_size": self.out_hidden_size,
        }


def unit_tokens(kind: str, shape: Sequence[int], *, merge_size: int = 2,
                audio: AudioConfig | None = None) -> tuple[int, ...]:
    """LLM tokens of each encoder unit of one media item -- exactly the rows its encoder outputs
    for it, so the prompt layout (sized before anything is encoded), the media planner and the
    training data all count here (docs/model.md §3-§5).

        "image"  shape (t, gh, gw), the tower's patch grid (t = 1)  -> (t*gh*gw / merge²,)
        "video"  shape (G, gh, gw): G frame groups of gh x gw patches -> (gh*gw / merge²,) * G
        "audio"  shape (T,): a clip's log-mel frames, cut into ``segment_size`` segments (+ rest)
                 -> one count per segment, ``audio.segment_tokens``
        "audio_codes"  shape (T,): pre-tokenized RVQ code frames, cut into ``codes_per_segment``
                 segments (+ rest) -> one count per segment, ``audio.code_tokens`` (the counts of
                 the audio whose codes they are)
    """
    if kind in ("image", "video"):
        _require(len(shape) == 3 and min(shape) > 0, f"{kind} needs a positive (t, gh, gw) grid, got {tuple(shape)}")
        t, gh, gw = shape
        _require(gh % merge_size == 0 and gw % merge_size == 0,
                 f"{kind} grid {gh}x{gw} is not a whole number of {merge_size}x{merge_size} merge units")
        per_frame = gh * gw // (merge_size * merge_size)  # the tower merges m x m patches into one row
        return (t * per_frame,) if kind == "image" else (per_frame,) * t
    if kind in ("audio", "audio_codes"):
        _require(audio is not None, "audio token counts need the audio encoder's config")
        _require(len(shape) == 1 and shape[0] > 0, f"an audio clip needs at least one frame, got {tuple(shape)}")
        assert audio is not None
        segment, count = ((audio.segment_size, audio.segment_tokens) if kind == "audio" else
                          (audio.codes_per_segment, audio.code_tokens))
        full, rest = divmod(shape[0], segment)
        return tuple(count(n) for n in [segment] * full + ([rest] if rest else []))
    raise ValueError(f"unknown media kind {kind!r} (image, video, audio, audio_codes)")
