"""text_throughput.py's optional vLLM column skips cleanly: a missing interpreter, or one without
vLLM, gives no column (None) and a note instead of an error; the checkpoint copy vLLM reads spells
the config the hub way and shares the weights."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO


@pytest.fixture(scope="module")
def text_throughput():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import text_throughput

        yield text_throughput
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tt") / "m", num_hidden_layers=3)


def test_vllm_checkpoint_has_the_hub_fields_and_the_same_weights(text_throughput, checkpoint: Path) -> None:
    out = text_throughput.vllm_checkpoint(checkpoint)
    hf = json.loads((checkpoint / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoV2FlashForCausalLM"] and cfg["model_type"] == "mimo_v2_flash"
    kinds = {"full_attention": 0, "sliding_attention": 1}
    assert cfg["hybrid_layer_pattern"] == [kinds[k] for k in hf["layer_types"]]
    assert cfg["moe_layer_freq"] == [int(k == "sparse") for k in hf["mlp_layer_types"]]
    assert "attention_projection_layout" not in cfg  # the weights keep q/k/v apart
    from llm_core.model.config import ModelConfig

    # vLLM reads the window field as visible keys: it gets ours, not the hub's previous-token count
    assert cfg["sliding_window_size"] == cfg["sliding_window"] == ModelConfig.from_hf(hf).sliding_window
    weights = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    assert weights and all((out / w).resolve() == (checkpoint / w).resolve() for w in weights)
    assert text_throughput.vllm_checkpoint(checkpoint) == out  # a second call reuses the copy


def test_missing_interpreter_skips(text_throughput, capsys, tmp_path: Path) -> None:
    got = text_throughput.time_vllm(str(tmp_path / "no-python"), tmp_path, {1: [[5, 6]]}, 2, 1, 16)
    assert got is None
    assert "does not exist; column skipped" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_interpreter_without_vllm_skips(text_throughput, capsys, checkpoint: Path) -> None:
    got = text_throughput.time_vllm(sys.executable, checkpoint, {1: [[5, 6]]}, 2, 1, 16)
    assert got is None
    out = capsys.readouterr().out
    assert "could not run it" in out and "vllm" in out
