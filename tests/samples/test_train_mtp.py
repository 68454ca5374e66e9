"""The MTP training forward (samples/training/train_mtp.py) is the served one: the dense, differentiable
pass-0 forward equals the engine's paged MTP layer on the same rows, and the export round-trips through
the loader (fused qkv disk order included)."""

from __future__ import annotations

import shutil

import pytest
import torch

from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout
from samples.training.train_mtp import MTP_FILE, check_against_engine, export, first_mode_passes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("hub", [False, True])
def test_dense_forward_matches_engine_and_export_round_trips(tmp_path, hub):
    src = build_tiny_hf_checkpoint(tmp_path / "hf", mtp_layers=3)
    if hub:
        src = write_hub_layout(src, tmp_path / "hub")
    model = load_model(src)
    head = model.model.mtp
    g = torch.Generator().manual_seed(0)
    n, h = 37, model.config.hidden_size  # longer than the window (8): the band matters
    item = dict(tokens=torch.randint(3, 500, (n + 1,), generator=g), embeds=torch.randn(n, h, generator=g),
                hidden=torch.randn(n, h, generator=g), prompt_len=20)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))  # weights the checkpoint does not have
    out = tmp_path / "out"
    shutil.copytree(src, out)
    (out / MTP_FILE).unlink(missing_ok=True)
    for f in out.glob("*.safetensors"):  # drop the original MTP tensors: the export provides them
        from safetensors.torch import load_file, save_file
        t = {k: v for k, v in load_file(str(f)).items() if not k.startswith("model.mtp.")}
        save_file(t, str(f), metadata={"format": "pt"})
    export(head, model.config, out)
    reloaded = load_model(out).model.mtp
    for (name, a), (_, b) in zip(head.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), name
    assert check_against_engine(out, item) < 1e-4
    passes = first_mode_passes(head.layers[0], item["embeds"], item["hidden"], model.config.sliding_window, 3)
    assert len(passes) == 3 and all(torch.isfinite(p).all() for p in passes)


def test_record_keeps_every_position_hidden_state():
    """MTP training data needs the final hidden state of every position, while the engine's last
    layer runs the sampling rows only by default: ``record`` asks the runner for every row, so the
    recorded rows cover the sequence once, and each generated position's row gives its greedy token."""
    from samples.synthetic.generate import read_labels
    from samples.training.train_mtp import record
    from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

    labels = [lab for lab in read_labels(SAMPLE_MEDIA / "labels.jsonl") if lab["modality"] == "image"][:1]
    (item,) = record(DEMO_MODEL, SAMPLE_MEDIA, labels)
    n, p = len(item["tokens"]) - 1, item["prompt_len"]
    assert item["hidden"].shape[0] == item["embeds"].shape[0] == n > p
    model = load_model(DEMO_MODEL).float().eval()
    with torch.inference_mode():
        greedy = model.compute_logits(item["hidden"][p - 1:]).argmax(-1)
    assert torch.equal(greedy, item["tokens"][p:])
