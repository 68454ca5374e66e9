"""Trained :class:`OmniTrainModel` -> an omni checkpoint directory (the layout of
``samples.checkpoints.tiny_omni``) that ``OmniModel.load`` / ``mmserve caption`` serve.

    text   HF save_pretrained (tmp) ─► samples.checkpoints.tiny_text.write_hub_layout (fused qkv, hub config)
    towers save_modules ─► model-encoders.safetensors (visual.*, audio_encoder.*), added to the index
    config + vision_config + audio_config + processor_config + special token ids
    tokenizer.json / tokenizer_config.json (byte-level BPE with the demo merges + chat template)

Weights stay float32 (the whole checkpoint is a few MB) so the served math is the trained math.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from encoders.weights import save_modules
from samples.checkpoints.tiny_text import write_hub_layout
from samples.checkpoints.tiny_omni import tiny_special_tokens
from samples.training.demo_tokenizer import demo_tokenizer
from samples.training.omni_trainer import OmniTrainModel

ENCODER_SHARD = "model-encoders.safetensors"


def export_checkpoint(model: OmniTrainModel, out_dir: str | Path, extra_config: dict | None = None, *,
                      hears_video_sound: bool = False) -> Path:
    """Write ``model`` as a servable checkpoint into ``out_dir`` (replaced atomically); returns it."""
    out = Path(out_dir)
    special = tiny_special_tokens()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model.text.save_pretrained(Path(tmp) / "hf")
            write_hub_layout(Path(tmp) / "hf", staging)
        save_modules(staging / ENCODER_SHARD, {"visual.": model.vision, "audio_encoder.": model.audio})
        index_path = staging / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update({f"visual.{n}": ENCODER_SHARD for n in model.vision.state_dict()})
        index["weight_map"].update({f"audio_encoder.{n}": ENCODER_SHARD for n in model.audio.state_dict()})
        index_path.write_text(json.dumps(index, indent=1))
        cfg = json.loads((staging / "config.json").read_text())
        cfg.update(special.to_config())
        cfg.update({
            "vision_model_type": "mimovl",
            "vision_config": model.config.vision.to_dict(),
            "audio_config": model.config.audio.to_dict(),
            # the server lays out a video's sound track only for a model trained on videos with sound
            "processor_config": {**model.config.processor_config(special), "use_audio_in_video": hears_video_sound},
        })
        if extra_config:
            cfg.update(extra_config)
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
        demo_tokenizer().save_pretrained(str(staging))
        staging.chmod(0o755)  # mkdtemp makes 0700 dirs; safetensors writes 0600 files
        for f in staging.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def load_checkpoint_into(model: OmniTrainModel, ckpt_dir: str | Path) -> OmniTrainModel:
    """The inverse of :func:`export_checkpoint`: copy a servable demo checkpoint's weights into
    ``model`` (text model, ViT, audio encoder; the training-only probe heads keep their init).

    The hub layout's fused ``qkv_proj`` (``tp4_chunks`` row order, as export writes it) is split
    back into q/k/v; MTP layers (``model.mtp.*``, trained separately) are skipped. Every tensor the
    trainable model has must be in the checkpoint with the same shape, and the checkpoint must hold
    nothing else: a mismatch (another architecture, another config) is a ``ValueError`` naming it."""
    from llm_core.model.config import ModelConfig
    from llm_core.model.layers.fused_qkv import chunk_count, disk_rows_of_plain
    from encoders.weights import read_prefixed

    ckpt = Path(ckpt_dir)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"--init-from {ckpt}: no config.json (not a checkpoint directory)")
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--init-from {ckpt}: no .safetensors files")
    config = ModelConfig.from_pretrained(ckpt)
    every = read_prefixed(files, "")
    text: dict[str, torch.Tensor] = {}
    for name, t in every.items():
        if name.startswith(("visual.", "audio_encoder.", "model.mtp.")):
            continue
        if name.endswith("self_attn.qkv_proj.weight"):
            i = int(name.split(".")[2])
            spec = config.attn_spec(i)
            plain = t[disk_rows_of_plain(spec, chunk_count(spec, config.fused_qkv_chunks, "tp4_chunks"))]
            p = name[: -len("qkv_proj.weight")]
            q, k, v = plain.split([spec.q_size, spec.k_size, spec.v_size])
            text.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
        else:
            text[name] = t
    towers = {
        "vision tower": (model.vision, {n[len("visual."):]: t for n, t in every.items() if n.startswith("visual.")}),
        "audio encoder": (model.audio, {n[len("audio_encoder."):]: t for n, t in every.items()
                                        if n.startswith("audio_encoder.")}),
    }
    with tempfile.TemporaryDirectory() as tmp:
        # The text model's on-disk spelling is whatever transformers' save_pretrained writes (it
        # converts fused experts, renames sinks): compare against that, then load through
        # from_pretrained so the same conversions run backwards.
        hf = Path(tmp) / "hf"
        model.text.save_pretrained(hf)
        reference = {}
        for f in sorted(hf.glob("*.safetensors")):
            reference.update(read_prefixed(f, ""))
        _check_match(ckpt, "text model", reference, text)
        for what, (module, state) in towers.items():
            _check_match(ckpt, what, module.state_dict(), state)
        for f in list(hf.glob("*.safetensors")) + list(hf.glob("*.safetensors.index.json")):
            f.unlink()
        save_file({n: t.contiguous() for n, t in text.items()}, str(hf / "model.safetensors"), metadata={"format": "pt"})
        loaded = type(model.text).from_pretrained(hf, config=model.text.config, dtype=torch.float32)
        state = loaded.state_dict()
    with torch.no_grad():
        mine = model.text.state_dict()
        if set(mine) != set(state):
            raise ValueError(f"--init-from {ckpt}: transformers loaded a text model with other tensors than the "
                             f"trainable one: {sorted(set(mine) ^ set(state))[:6]}")
        for n, t in state.items():
            mine[n].copy_(t)
        for what, (module, tower_state) in towers.items():
            own = module.state_dict()
            for n, t in tower_state.items():
                own[n].copy_(t.to(own[n].dtype))
    return model


def _check_match(ckpt: Path, what: str, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad = [f"{n}: checkpoint {tuple(state[n].shape)} vs model {tuple(expected[n].shape)}"
           for n in sorted(set(state) & set(expected)) if tuple(state[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or bad:
        raise ValueError(f"--init-from {ckpt}: the {what} does not match the trainable model: "
                         f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}, "
                         f"shape mismatches {bad[:6]}{'...' if len(bad) > 6 else ''}")
