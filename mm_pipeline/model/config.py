"""One omni checkpoint's configuration: text model + vision tower + audio encoder + processor + ids.

    config.json (model_type "mimo_v2", hub text spelling)
      ├─ text fields        -> llm_core.model.config.ModelConfig.from_hf
      ├─ vision_config      -> encoders.config.VisionConfig.from_dict
      ├─ audio_config       -> encoders.config.AudioConfig.from_dict (processor audio_* names fill gaps:
      │                        front end, segments, token counts -- both audio paths); when it
      │                        describes the MiMo-V2.5 reference path (input local transformer),
      │                        also -> encoders.audio.mimo_config.SpeechInputConfig (``speech``)
      ├─ processor_config   -> ImageProcessingConfig, VideoSamplingParams, use_video_timestamps, token ids
      └─ *_token_id         -> SpecialTokens (top level first, then processor_config)

Defaults are the real MiMo-V2.5 values (docs/model.md §1, §5.1); a tiny checkpoint overrides the ids
so they fit its small vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from encoders.audio.mimo_config import SpeechInputConfig
from encoders.config import AudioConfig, VisionConfig
from encoders.image_processing import ImageProcessingConfig
from llm_core.model.config import ModelConfig, read_config_json
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the prompt-layout tokens. Field -> config key in :data:`CONFIG_KEYS`, -> string in
    :data:`STRINGS`."""

    pad: int = 151643
    im_start: int = 151644
    im_end: int = 151645
    vision_start: int = 151652
    vision_end: int = 151653
    image_pad: int = 151655
    video_pad: int = 151656
    audio_pad: int = 151669
    video_start: int = 151670
    video_end: int = 151671
    audio_start: int = 151673
    audio_end: int = 151674

    def __post_init__(self) -> None:
        ids = self.as_dict()
        seen: dict[int, str] = {}
        for name, value in ids.items():
            if value < 0:
                raise ValueError(f"special token {name} has negative id {value}")
            if value in seen:
                raise ValueError(f"special tokens {seen[value]} and {name} share id {value}")
            seen[value] = name

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "SpecialTokens":
        """Top-level keys win over ``processor_config`` keys; absent keys keep the real ids."""
        processor = cfg.get("processor_config") or {}
        values = {}
        for name, key in CONFIG_KEYS.items():
            for src in (cfg, processor):
                if src.get(key) is not None:
                    values[name] = _single_id(src[key], key)
                    break
        return cls(**values)

    def to_config(self) -> dict[str, int]:
        return {CONFIG_KEYS[name]: value for name, value in self.as_dict().items()}

    @property
    def strings(self) -> dict[str, str]:
        """Token string -> id."""
        return {STRINGS[name]: value for name, value in self.as_dict().items()}


CONFIG_KEYS = {
    "pad": "pad_token_id", "im_start": "im_start_token_id", "im_end": "eos_token_id",
    "vision_start": "vision_start_token_id", "vision_end": "vision_end_token_id",
    "image_pad": "image_token_id", "video_pad": "video_token_id", "audio_pad": "audio_token_id",
    "video_start": "video_start_token_id", "video_end": "video_end_token_id",
    "audio_start": "audio_start_token_id", "audio_end": "audio_end_token_id",
}
STRINGS = {
    "pad": "<|endoftext|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>", "audio_pad": "<|audio_pad|>", "video_start": "<|mimo_video_start|>",
    "video_end": "<|mimo_video_end|>", "audio_start": "<|mimo_audio_start|>", "audio_end": "<|mimo_audio_end|>",
}


def _single_id(value: Any, key: str) -> int:
    # eos_token_id may be a list in HF configs; the chat end token is its first entry.
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{key} is an empty list")
        value = value[0]
    return int(value)


def _flag(value: Any, default: bool) -> bool:
    return default if value is None else bool(value)


@dataclass(frozen=True)
class OmniConfig:
    text: ModelConfig
    vision: VisionConfig | None
    audio: AudioConfig | None
    image_processing: ImageProcessingConfig
    video: VideoSamplingParams
    special: SpecialTokens
    # the reference audio path's codes -> embeddings part (None: our audio encoder, or no audio)
    speech: SpeechInputConfig | None = None
    # "MM:SS" of each frame group before its pads in the prompt (processor_config.use_video_timestamps;
    # MiMo-V2.5 and the demo model were trained with them)
    use_video_timestamps: bool = True
    # a video's sound track laid out with its frames (processor_config.use_audio_in_video, true when
    # absent as in MiMo-V2.5; a checkpoint never trained on videos with sound sets it false, since sound
    # tokens it has never seen beside frames disturb its answers about the frames)
    video_audio: bool = True

    def __post_init__(self) -> None:
        hidden = self.text.hidden_size
        if self.vision is not None:
            if self.vision.out_hidden_size != hidden:
                raise ValueError(f"vision_config.out_hidden_size {self.vision.out_hidden_size} != text hidden_size "
                                 f"{hidden}: image embeddings cannot replace token embeddings")
            ip, v = self.image_processing, self.vision
            if (ip.patch_size, ip.temporal_patch_size, ip.merge_size) != (v.patch_size, v.temporal_patch_size,
                                                                           v.spatial_merge_size):
                raise ValueError(f"processor patch/temporal/merge {(ip.patch_size, ip.temporal_patch_size, ip.merge_size)}"
                                 f" disagree with vision_config {(v.patch_size, v.temporal_patch_size, v.spatial_merge_size)}")
        if self.video.frame_factor != self.image_processing.temporal_patch_size:
            raise ValueError(f"video frames are sampled in groups of {self.video.frame_factor} but the "
                             f"processor's temporal_patch_size is {self.image_processing.temporal_patch_size}")
        if self.speech is not None and self.speech.out_hidden_size != hidden:
            raise ValueError(f"audio_config.out_hidden_size {self.speech.out_hidden_size} != text hidden_size {hidden}")
        if self.audio is not None and self.audio.out_hidden_size != hidden:
            raise ValueError(f"audio_config.out_hidden_size {self.audio.out_hidden_size} != text hidden_size {hidden}")
        too_big = {n: i for n, i in self.special.as_dict().items() if i >= self.text.vocab_size}
        if too_big:
            raise ValueError(f"special token ids {too_big} outside the vocabulary ({self.text.vocab_size})")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "OmniConfig":
        processor = cfg.get("processor_config") or {}
        audio = speech = None
        if cfg.get("audio_config") is not None:
            # processor audio_* names fill what audio_config leaves out (front end geometry).
            audio = AudioConfig.from_dict({**processor, **cfg["audio_config"]})
            if SpeechInputConfig.is_reference(cfg["audio_config"]):
                speech = SpeechInputConfig.from_dict(cfg["audio_config"])
        return cls(
            text=ModelConfig.from_hf(cfg),
            vision=VisionConfig.from_dict(cfg["vision_config"]) if cfg.get("vision_config") is not None else None,
            audio=audio,
            image_processing=ImageProcessingConfig.from_dict(processor),
            video=VideoSamplingParams.from_processor_config(processor),
            special=SpecialTokens.from_config(cfg),
            speech=speech,
            use_video_timestamps=_flag(processor.get("use_video_timestamps"), default=True),
            video_audio=_flag(processor.get("use_audio_in_video"), default=True),
        )

    @property
    def audio_path(self) -> str | None:
        """Which audio encoder the checkpoint selects: "reference" (MiMo-V2.5 RVQ tokenizer + local
        transformer), "ours" (log-mel transformer, encoders.audio.encoder) or None (no audio)."""
        if self.audio is None:
            return None
        return "reference" if self.speech is not None else "ours"

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "OmniConfig":
        return read_config_json(model_dir, cls.from_hf)
