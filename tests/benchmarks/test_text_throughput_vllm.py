"""text_throughput.py's optional vLLM column skips cleanly: a missing interpreter, or one without
vLLM, gives no column (None) and a note instead of an error."""

from __future__ import annotations

import importlib.util
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


def test_missing_interpreter_skips(text_throughput, capsys, tmp_path: Path) -> None:
    got = text_throughput.time_vllm(str(tmp_path / "no-python"), tmp_path, {1: [[5, 6]]}, 2, 1, 16)
    assert got is None
    assert "does not exist; column skipped" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_interpreter_without_vllm_skips(text_throughput, capsys, tmp_path: Path) -> None:
    got = text_throughput.time_vllm(sys.executable, tmp_path, {1: [[5, 6]]}, 2, 1, 16)
    assert got is None
    out = capsys.readouterr().out
    assert "could not run it" in out and "vllm" in out
