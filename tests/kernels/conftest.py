"""Shared fixtures of the kernel tests that run whole engines."""

from __future__ import annotations

import pytest

from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny HF-layout MiMo-V2 checkpoint, one per test module (module scope, as before)."""
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")
