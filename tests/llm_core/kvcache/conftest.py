"""The tiny text model the prefix-cache and tier tests run an engine over."""

from __future__ import annotations

import pytest
import torch

from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """fp32 (the CPU compute dtype); module scope: each test module gets its own weights, so an engine
    in one module never sees state another module left on the model."""
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)
