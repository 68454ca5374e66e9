"""OmniModel: one omni checkpoint directory loaded as its parts.

    config.json ─┬─ text fields            ─► llm_core.distributed.launcher.load_text_model (model.*, lm_head.*; one process or TP/EP ranks;
                 │                            skipped with ``with_text=False``: an encoder replica needs only what is below)
                 ├─ vision_config          ─► VisionTransformer           (visual.*)
                 ├─ audio_config           ─► AudioEncoder                (audio_encoder.*), or for the
                 │                            MiMo-V2.5 reference path  MimoAudioEncoder (speech_embeddings.*,
                 │                            audio_encoder.*, audio_tokenizer/ encoder.*)
                 └─ processor_config       ─► ImageProcessingConfig, video sampling, token ids, prompt layout
    tokenizer files                        ─► transformers AutoTokenizer

``encoder_id`` names the encoder weights for content-hash keys: a digest of the config, of every
shard's safetensors header and size, and of every byte of the encoders' tensors (a fine-tune of a
tower changes no header), with the compute dtype, so cache entries of another checkpoint or dtype
are never served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

from encoders.audio.encoder import AudioEncoder
from encoders.config import AudioConfig
from encoders.image_processing import ImageProcessingConfig
from encoders.vision.tower import VisionTransformer
from encoders.audio.mimo_audio import MimoAudioEncoder
from encoders.weights import (AUDIO_PREFIX, SPEECH_PREFIX, TOKENIZER_DIR, VISION_PREFIX, load_audio_encoder,
                              load_mimo_audio_encoder, load_vision_tower)
from llm_core.llm import load_tokenizer
from llm_core.model.dtype import parse_dtype
from llm_core.distributed.launcher import load_text_model
from llm_core.model.config import ModelConfig
from llm_core.model.mimo_v2 import MiMoV2ForCausalLM
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.model.config import OmniConfig
from mm_pipeline.prompt.layout import ChatLayout


ENCODER_PREFIXES = (VISION_PREFIX, AUDIO_PREFIX, SPEECH_PREFIX)  # the towers' tensors in the main shards
_READ = 16 << 20  # bytes hashed per read


def encoder_id_of(model_dir: Path) -> str:
    """Digest of config.json, each shard's name, size and safetensors header, and every byte of the
    encoders' tensors (``ENCODER_PREFIXES``, and the whole audio tokenizer): stable across restarts,
    different for any other checkpoint -- a fine-tune of the vision tower has the same names, shapes
    and sizes, and must not be served the base model's cached rows. The text model's bytes are not
    read here (its KV entries carry its own fingerprint); the encoders' are read once more at start
    (a fraction of a second per GB, mostly from the page cache the load just filled)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update((model_dir / "config.json").read_bytes())
    tokenizer_config = model_dir / TOKENIZER_DIR / "config.json"
    if tokenizer_config.is_file():  # the reference audio path's tokenizer is part of the encoder
        h.update(tokenizer_config.read_bytes())
    main = sorted(model_dir.glob("*.safetensors"))
    for shard in main + sorted((model_dir / TOKENIZER_DIR).glob("*.safetensors")):
        with shard.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = f.read(min(n, 64 << 20))
            h.update(shard.name.encode())
            h.update(shard.stat().st_size.to_bytes(8, "little"))
            h.update(header)
            for start, end in _encoder_ranges(header, every=shard not in main):
                f.seek(8 + n + start)
                while start < end:
                    chunk = f.read(min(_READ, end - start))
                    if not chunk:
                        raise ValueError(f"{shard} ends inside a tensor its header declares")
                    h.update(chunk)
                    start += len(chunk)
    return h.hexdigest()[:32]


def _encoder_ranges(header: bytes, every: bool) -> list[tuple[int, int]]:
    """Byte ranges (from the data start, in file order) of a shard's encoder tensors; ``every``: all
    of them (an audio tokenizer shard)."""
    try:
        entries = json.loads(header)
    except ValueError:
        return []  # the loader reports a broken header, by its own rules
    return sorted(tuple(v["data_offsets"]) for k, v in entries.items()
                  if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
                  and (every or k.startswith(ENCODER_PREFIXES)))


def _encoder_id(model_dir: Path, omni: OmniConfig, tokenizer_attention: str, dtype: torch.dtype) -> str:
    """The weights' id, plus what else changes the rows computed from them: the compute dtype (an
    encoder cache shared by a float32 CPU run and bf16 GPU replicas must keep their rows apart) and
    the reference tokenizer's attention reading when it is not the default."""
    parts = [encoder_id_of(model_dir), str(dtype).removeprefix("torch.")]
    if omni.audio_path == "reference" and tokenizer_attention != "reference":
        parts.append(tokenizer_attention)
    return blake3.blake3(":".join(parts).encode()).hexdigest()[:32]


def _has_prefix(model_dir: Path, prefix: str) -> bool:
    from safetensors import safe_open

    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if any(name.startswith(prefix) for name in f.keys()):
                return True
    return False


@dataclass(eq=False)
class OmniModel:
    """The loaded parts; see module doc. ``layout`` renders chats with media into token ids."""

    name: str
    text: MiMoV2ForCausalLM | None  # None: loaded encoders-only (with_text=False)
    text_config: ModelConfig
    vision: VisionTransformer | None
    audio: AudioEncoder | MimoAudioEncoder | None
    tokenizer: Any
    image_config: ImageProcessingConfig
    audio_config: AudioConfig | None
    layout: ChatLayout
    video_sampling: VideoSamplingParams
    encoder_id: str
    # whether the checkpoint was trained to hear a video's sound track (processor_config.use_audio_in_video)
    video_audio: bool = True

    device: torch.device = torch.device("cpu")  # the text model's (without one: the encoders')

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def audio_codebooks(self) -> tuple[int, ...] | None:
        """Codebook sizes of the RVQ stages the reference audio path reads: what pre-tokenized
        audio codes are checked against (None: the model takes waveforms only)."""
        return self.audio.codebook_sizes if isinstance(self.audio, MimoAudioEncoder) else None

    @property
    def encoder_device(self) -> torch.device:
        tower = self.vision if self.vision is not None else self.audio
        return tower.device if tower is not None else self.device

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str | torch.device = "cpu",
             dtype: str | torch.dtype = "float32", tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
             distributed_timeout_s: float = 600.0, encoder_device: str | torch.device | None = None,
             audio_tokenizer_attention: str = "reference", with_text: bool = True,
             chat_template: str | None = None, with_vision: bool = True, with_audio: bool = True,
             fp8_experts: bool | None = None, load_mtp: bool = True) -> "OmniModel":
        """The text model goes through ``load_text_model`` (one process, or one per tensor / expert
        parallel rank); the encoders stay whole (data-parallel, never tensor-parallel) on
        ``encoder_device`` (default: ``device``). ``audio_tokenizer_attention``: for the reference
        audio path, how its tokenizer attends ("reference" or "bidirectional",
        encoders.audio.mimo_config); ignored otherwise. ``with_text=False``: no text model (no
        ``model.*`` / ``lm_head.*`` weight is read; ``text`` is None), for a process that only
        encodes media (an encoder replica, mm_pipeline/cluster/serving/encoder_replica.py).
        ``chat_template``: template text used instead of the tokenizer's own (``--chat-template``).
        ``with_vision`` / ``with_audio`` False: that encoder is not loaded (a server that refuses the
        modality, --limit-mm-per-prompt: its weights take no memory), as if the checkpoint had none.
        ``fp8_experts``: the text model's routed experts kept in block-FP8; ``load_mtp``: its MTP
        layers loaded (both ``load_model``'s)."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}: not a model directory")
        omni = OmniConfig.from_pretrained(model_dir)  # validates widths, patch geometry, token ids
        dt = parse_dtype(dtype)
        text = None
        if with_text:
            text = load_text_model(model_dir, device=device, dtype=dt, tensor_parallel_size=tensor_parallel_size,
                                   expert_parallel_size=expert_parallel_size,
                                   distributed_timeout_s=distributed_timeout_s, fp8_experts=fp8_experts,
                                   load_mtp=load_mtp)
        enc = device if encoder_device is None else encoder_device
        vision = audio = None
        if with_vision and omni.vision is not None and _has_prefix(model_dir, VISION_PREFIX):
            vision = load_vision_tower(omni.vision, model_dir, device=enc, dtype=dt)
        if with_audio and omni.audio_path == "reference":
            audio = load_mimo_audio_encoder(omni.audio, omni.speech, model_dir, device=enc, dtype=dt,
                                            tokenizer_attention=audio_tokenizer_attention)
        elif with_audio and omni.audio is not None and _has_prefix(model_dir, AUDIO_PREFIX):
            audio = load_audio_encoder(omni.audio, model_dir, device=enc, dtype=dt)
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise FileNotFoundError(f"{model_dir} has no tokenizer files; an omni model needs one")
        if chat_template is not None:
            tokenizer.chat_template = chat_template  # before the layout measures the template (ChatLayout)
        text_device = next(text.parameters()).device if text is not None else torch.device(enc)
        for dev in {torch.device(enc), text_device}:
            if dev.type == "cuda":  # the weights' copies and casts ran on this thread's default stream;
                torch.cuda.synchronize(dev)  # the encoder's own stream would not wait for them
        return cls(name=model_dir.resolve().name, text=text, text_config=omni.text, device=text_device, vision=vision, audio=audio, tokenizer=tokenizer,
                   image_config=omni.image_processing, audio_config=omni.audio if audio is not None else None,
                   layout=ChatLayout(omni.special, tokenizer, omni.use_video_timestamps),
                   video_sampling=omni.video, encoder_id=_encoder_id(model_dir, omni, audio_tokenizer_attention, dt),
                   video_audio=omni.video_audio)


