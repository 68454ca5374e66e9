"""Bad command-line values are usage errors (exit 2) naming the flag, never a traceback: the ones
argparse checks through the config dataclasses, and the ones known only once the checkpoint is read
(its config.json, its weights, shapes the parallel sizes or the KV budget must fit). ``mmserve serve``
as a user runs it; every case fails before anything listens."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mm_pipeline import cli
from tests.support.paths import DEMO_MODEL

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")


def _checkpoint(tmp_path, kind: str) -> str:
    """A model directory broken one way: config.json not JSON, lacking fields, or no weights."""
    path = tmp_path / kind
    path.mkdir()
    if kind == "no-weights":
        for f in DEMO_MODEL.glob("*.json"):
            shutil.copy(f, path)
    else:
        (path / "config.json").write_text("{not json" if kind == "bad-json" else "{}")
    return str(path)


@pytest.mark.parametrize("argv, flag", [
    (["--page-size", "0"], "--page-size"),
    (["--page-size", "-1"], "--page-size"),
    (["--num-full-tokens", "-1"], "--num-full-tokens"),
    (["--num-swa-tokens", "-1"], "--num-swa-tokens"),
    (["--device", "bogus"], "--device"),
    (["--max-upload-mb", "nan"], "--max-upload-mb"),
    (["--max-upload-mb", "inf"], "--max-upload-mb"),
    (["--max-upload-mb", "-1"], "--max-upload-mb"),
    (["--max-media-mb", "inf"], "--max-media-mb"),
    (["--max-media-mb", "-3"], "--max-media-mb"),
])
def test_bad_values_exit_2_naming_the_flag_before_anything_loads(argv, flag, capsys, monkeypatch):
    """Refused as argparse reads them (in process: nothing is loaded or bound before)."""
    monkeypatch.setenv("MMSERVE_API_KEY", "")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", str(DEMO_MODEL), "--host", "127.0.0.1", "--port", "0", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, flag", [
    (["--kv-cache-bytes", "1"], "--kv-cache-bytes"),
    (["--num-swa-tokens", "0"], "--num-swa-tokens"),  # the demo model has sliding layers
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),  # its vocabulary of 512 does not split in 3
    (["--max-model-len", "99999999"], "--max-model-len"),  # past its max_position_embeddings (vLLM refuses it too)
    ("bad-json", "--model"),
    ("no-fields", "--model"),
    ("no-weights", "--model"),
])
def test_values_known_once_the_checkpoint_is_read_exit_2_naming_the_flag(argv, flag, tmp_path):
    """``mmserve serve`` in a child process, as a user runs it (the model loads there)."""
    if isinstance(argv, str):
        argv = ["--model", _checkpoint(tmp_path, argv)]
    else:
        argv = ["--model", str(DEMO_MODEL), *argv]
    proc = subprocess.run([sys.executable, "-m", "mm_pipeline.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                           "--port", "0", *argv],  # port 0: tests running side by side never share one
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MMSERVE_API_KEY": ""})
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("flag", ["--cache-dir", "--encoder-cache-dir", "--kv-store"])
def test_a_cache_directory_that_is_a_file_exits_2_before_loading(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMSERVE_API_KEY", "")
    (tmp_path / "afile").write_text("x")
    for where in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        code = cli.main(["serve", "--model", str(DEMO_MODEL), "--host", "127.0.0.1", "--port", "0", flag, str(where)])
        err = capsys.readouterr().err
        assert code == 2 and "is not a directory" in err and flag.lstrip("-") in err and "Traceback" not in err, err
