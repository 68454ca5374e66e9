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
