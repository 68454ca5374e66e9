"""Shared fixtures of the kernel tests: a tiny checkpoint for those that run whole engines, the vector
width of the C paged decode attention's build."""

from __future__ import annotations

import functools

import pytest

from kernels.native import paged_decode
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny HF-layout MiMo-V2 checkpoint, one per test module (module scope, as before)."""
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(params=["native width", "8 lanes"])
def width(request, monkeypatch):
    """Each test runs on the host's vector width and on the 8-lane form (AVX2 hosts, other CPUs)."""
    if request.param == "8 lanes":
        monkeypatch.setattr(paged_decode, "_lib",
                            functools.partial(paged_decode._lib, paged_decode.FLAGS + ("-DPAGED_DECODE_VL8",)))
    return request.param
