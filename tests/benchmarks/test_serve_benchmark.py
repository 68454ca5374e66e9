"""benchmarks/serve.py end to end (``--quick``, one load level): the served load has no errors and
reports the server's event-loop lag, and ``mmserve caption`` gives the same greedy captions as the
transformers-style per-item loop (decode -> preprocess -> encoder -> ``generate``), item for item
(images, videos, audio). The script's reference loop broke once unnoticed when the layout's input
changed; this keeps it, and the agreement it reports, honest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def test_serve_quick_captions_agree_with_the_transformers_loop(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve.py"), "--quick", "--levels", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["c1_errors"] == 0 and got["c1_requests"] >= 8
    assert got["event_loop_lag_max_ms"] >= 0
    assert got["caption_failed"] == 0
    assert got["captions_identical"] == got["caption_items"] == 30
