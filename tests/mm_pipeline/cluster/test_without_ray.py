"""Without ``--ray`` nothing changes and Ray is not imported: ``mmserve serve`` in a child process
(uvicorn.Server.run replaced by a stub that records the app) loads the engine, builds the app, and leaves
``ray`` out of ``sys.modules``; the ``--ray`` flags parse and a bad value is a usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mm_pipeline.cli import build_parser, main
from tests.support.paths import DEMO_MODEL, REPO

CHILD = f"""
import sys, uvicorn
seen = []
uvicorn.Server.run = lambda self, *a, **kw: seen.append(self.config.app)
from mm_pipeline.cli import main
rc = main(["serve", "--model", {str(DEMO_MODEL)!r}, "--device", "cpu"])
assert rc == 0 and len(seen) == 1, (rc, seen)
print("RAY_IMPORTED" if any(m == "ray" or m.startswith("ray.") for m in sys.modules) else "NO_RAY")
"""


@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
def test_serve_without_ray_never_imports_it():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "NO_RAY"


def test_ray_flags_parse():
    args = build_parser().parse_args(["serve", "--model", "m", "--ray", "--llm-replicas", "3", "--router", "pow2"])
    assert args.ray == "" and args.llm_replicas == 3 and args.router == "pow2"
    assert build_parser().parse_args(["serve", "--model", "m", "--ray", "auto"]).ray == "auto"
    assert build_parser().parse_args(["serve", "--model", "m"]).ray is None


def test_bad_cluster_layout_is_a_usage_error(capsys):
    assert main(["serve", "--model", str(DEMO_MODEL), "--device", "cpu", "--ray", "--llm-replicas", "0"]) == 2
    assert "at least one LLM" in capsys.readouterr().err
