"""Safetensors I/O for the encoders, by checkpoint parameter name.

Towers are built on the ``meta`` device and receive their tensors with ``load_state_dict(assign=True)``
from memory-mapped safetensors files, so loading never allocates a random init first. A checkpoint may
be split over several files and hold other modules (text model, ...): only names under ``prefix`` are
read (``visual.`` for the vision tower, ``audio_encoder.`` for the audio encoder).

The MiMo-V2.5 reference audio path (:func:`load_mimo_audio_encoder`) reads two places: the main
checkpoint's ``speech_embeddings.*`` and ``audio_encoder.*``, and the ``audio_tokenizer/``
sub-checkpoint's ``encoder.*`` (its ``decoder.*`` vocoder and the quantizer's training buffers are
not needed to understand audio and are not read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from encoders.audio.encoder import AudioEncoder
from encoders.audio.mimo_audio import MimoAudioEncoder
from encoders.audio.mimo_config import AudioTokenizerConfig, SpeechInputConfig
from encoders.config import AudioConfig, VisionConfig
from encoders.vision.tower import VisionTransformer

VISION_PREFIX = "visual."
AUDIO_PREFIX = "audio_encoder."
# The real MiMo-V2.5 audio path (RVQ tokenizer + input local transformer, docs/model.md §4) shares
# the audio_encoder.* prefix but not our architecture.
RVQ_AUDIO_MARKER = "input_local_transformer."
SPEECH_PREFIX = "speech_embeddings."
TOKENIZER_DIR = "audio_tokenizer"
TOKENIZER_PREFIX = "encoder."
# EMA training state of the RVQ codebooks, kept in the checkpoint; encoding needs only ``embed``
_QUANTIZER_TRAINING = ("cluster_size", "embed_avg", "inited")


class UnsupportedAudioCheckpoint(ValueError):
    """The checkpoint's audio weights belong to the other audio path than its config selects (our
    encoder's loader given the reference RVQ path's tensors)."""

M = TypeVar("M", bound=nn.Module)


def _files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        p = Path(paths)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    else:
        files = [Path(x) for x in paths]
    if not files:
        raise FileNotFoundError(f"no .safetensors files found at {paths}")
    return files


def read_prefixed(paths, prefix: str, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Tensors whose names start with ``prefix`` (prefix stripped) from one file, a list, or a dir."""
    out: dict[str, torch.Tensor] = {}
    for f in _files(paths):
        with safe_open(str(f), framework="pt", device=str(device)) as handle:
            for name in handle.keys():
                if name.startswith(prefix):
                    t = handle.get_tensor(name)
                    out[name[len(prefix):]] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def load_into(module: M, state: dict[str, torch.Tensor], what: str) -> M:
    """Assign ``state`` to a (meta-built) module; any missing or unexpected name is an error."""
    expected = dict(module.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{what} checkpoint mismatch: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                       f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{what} tensor {name}: checkpoint shape {tuple(t.shape)}, "
                             f"model shape {tuple(expected[name].shape)}")
    module.load_state_dict(state, assign=True)
    return module


def _build_and_load(factory: Callable[[], M], paths, prefix: str, device, dtype, what: str) -> M:
    with torch.device("meta"):
        module = factory()
    return load_into(module, read_prefixed(paths, prefix, device=device, dtype=dtype), what).eval()


def load_vision_tower(config: VisionConfig, paths, device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None) -> VisionTransformer:
    """Vision tower with weights ``visual.*`` from safetensors file(s)."""
    return _build_and_load(lambda: VisionTransformer(config, dtype=dtype), paths, VISION_PREFIX, device, dtype,
                           "vision")


def load_audio_encoder(config: AudioConfig, paths, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> AudioEncoder:
    """Audio encoder with weights ``audio_encoder.*`` from safetensors file(s).

    Raises :class:`UnsupportedAudioCheckpoint` for a real MiMo-V2.5 checkpoint (RVQ audio path):
    that one loads with :func:`load_mimo_audio_encoder`."""
    state = read_prefixed(paths, AUDIO_PREFIX, device=device, dtype=dtype)
    if any(name.startswith(RVQ_AUDIO_MARKER) for name in state):
        raise UnsupportedAudioCheckpoint(
            "this checkpoint holds the MiMo-V2.5 RVQ audio path (audio_encoder.input_local_transformer.*, "
            "speech_embeddings.*, audio_tokenizer/); load it with load_mimo_audio_encoder")
    with torch.device("meta"):
        module = AudioEncoder(config, dtype=dtype)
    return load_into(module, state, "audio").eval()


def load_mimo_audio_encoder(front: AudioConfig, speech: SpeechInputConfig, model_dir: str | Path,
                            device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                            tokenizer_attention: str = "reference") -> MimoAudioEncoder:
    """The reference audio path of a MiMo-V2.5 checkpoint directory (see module doc).

    ``tokenizer_attention``: "reference" or "bidirectional" (encoders.audio.mimo_config)."""
    model_dir = Path(model_dir)
    tok_dir = model_dir / TOKENIZER_DIR
    if not (tok_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} selects the MiMo-V2.5 audio path (audio_config has the input local "
                                f"transformer) but has no {TOKENIZER_DIR}/config.json")
    tok_cfg = AudioTokenizerConfig.from_dict(json.loads((tok_dir / "config.json").read_text()), tokenizer_attention)
    state: dict[str, torch.Tensor] = {}
    for name, t in read_prefixed(tok_dir, TOKENIZER_PREFIX, device=device, dtype=dtype).items():
        if name.startswith("quantizer.") and name.rsplit(".", 1)[-1] in _QUANTIZER_TRAINING:
            continue
        state["tokenizer." + name] = t
    for i in range(tok_cfg.encoder_layers):  # a k_proj without bias is a zero bias
        key = f"tokenizer.layers.{i}.self_attn.k_proj.bias"
        if key not in state and f"tokenizer.layers.{i}.self_attn.k_proj.weight" in state:
            state[key] = torch.zeros(tok_cfg.d_model, device=device, dtype=dtype or torch.float32)
    for prefix in (SPEECH_PREFIX, AUDIO_PREFIX):
        for name, t in read_prefixed(model_dir, prefix, device=device, dtype=dtype).items():
            state["speech." + prefix + name] = t
    with torch.device("meta"):
        module = MimoAudioEncoder(front, tok_cfg, speech, dtype=dtype)
    return load_into(module, state, "MiMo-V2.5 audio").eval()


def prefixed_state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``module``'s tensors under checkpoint names (contiguous CPU copies, as safetensors wants)."""
    return {prefix + k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}


def save_modules(path: str | Path, modules: dict[str, nn.Module], extra: dict[str, torch.Tensor] | None = None,
                 ) -> None:
    """Write several modules (prefix -> module) plus optional extra tensors to one safetensors file."""
    state: dict[str, torch.Tensor] = dict(extra or {})
    for prefix, module in modules.items():
        state.update(prefixed_state(module, prefix))
    save_file(state, str(path))
