"""``train --init-from DIR`` (samples.training.export.load_checkpoint_into): a fine-tune starts from
exactly the weights an exported demo checkpoint holds, and a checkpoint of another shape is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from samples.checkpoints.tiny_omni import tiny_special_tokens
from samples.training.demo_model_config import DemoModelConfig
from samples.training.export import export_checkpoint, load_checkpoint_into
from samples.training.omni_trainer import OmniTrainModel


def _model(seed: int) -> OmniTrainModel:
    return OmniTrainModel(DemoModelConfig(), pad_id=tiny_special_tokens().pad, seed=seed)


def _served_state(model: OmniTrainModel) -> dict[str, torch.Tensor]:
    return ({"text." + n: t for n, t in model.text.state_dict().items()}
            | {"vision." + n: t for n, t in model.vision.state_dict().items()}
            | {"audio." + n: t for n, t in model.audio.state_dict().items()})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    source = _model(seed=1)
    with torch.no_grad():  # sinks and the probe-free parts start at zero / a fixed init: make every tensor distinct
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return source, export_checkpoint(source, tmp_path_factory.mktemp("ft") / "ckpt")


def test_exported_checkpoint_round_trips_through_init_from(exported, tmp_path):
    source, ckpt = exported
    target = _model(seed=2)
    before = _served_state(target)
    want = _served_state(source)
    assert any(not torch.equal(before[n], want[n]) for n in want)
    load_checkpoint_into(target, ckpt)
    got = _served_state(target)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # and exporting the initialised model writes the same tensors back
    again = export_checkpoint(target, tmp_path / "again")
    for shard in ("model-main.safetensors", "model-experts.safetensors", "model-encoders.safetensors"):
        a, b = load_file(str(ckpt / shard)), load_file(str(again / shard))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard


def test_init_from_refuses_a_mismatched_checkpoint(exported, tmp_path):
    _, ckpt = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    enc = load_file(str(bad / "model-encoders.safetensors"))
    name = next(n for n in enc if n.startswith("visual.") and enc[n].dim() == 2)
    enc[name] = torch.zeros(enc[name].shape[0] + 1, enc[name].shape[1])
    save_file(enc, str(bad / "model-encoders.safetensors"))
    with pytest.raises(ValueError, match="vision tower does not match.*shape mismatches"):
        load_checkpoint_into(_model(seed=3), bad)
    main = load_file(str(bad / "model-main.safetensors"))
    main.pop("model.embed_tokens.weight")
    save_file(main, str(bad / "model-main.safetensors"))
    with pytest.raises(ValueError, match="text model does not match.*missing"):
        load_checkpoint_into(_model(seed=3), bad)
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint_into(_model(seed=3), tmp_path)
    assert json.loads((ckpt / "config.json").read_text())["processor_config"]["use_audio_in_video"] is False
