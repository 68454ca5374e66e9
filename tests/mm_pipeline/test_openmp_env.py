"""mm_pipeline/openmp_env.py: importing mm_pipeline before torch gives libgomp mmserve's spin count;
a value or a wait policy the user set is kept; once torch is loaded nothing is set (the runtime would
not read it)."""

from __future__ import annotations

import os
import subprocess
import sys

from mm_pipeline.openmp_env import SPIN_COUNT, SPIN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def seen_in_child(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in (SPIN_ENV, "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_mm_pipeline_first_sets_the_spin_count_before_torch_loads():
    assert seen_in_child("import os, mm_pipeline, torch; print(os.environ.get('GOMP_SPINCOUNT'))") == str(SPIN_COUNT)
    # the CLI's import chain is mm_pipeline's: `mmserve` gets it
    assert seen_in_child("import os, mm_pipeline.cli; print(os.environ.get('GOMP_SPINCOUNT'))") == str(SPIN_COUNT)


def test_a_users_value_or_wait_policy_is_kept():
    code = "import os, mm_pipeline; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert seen_in_child(code, GOMP_SPINCOUNT="300000") == "300000"
    assert seen_in_child(code, OMP_WAIT_POLICY="PASSIVE") == "None"  # libgomp's own behaviour for it


def test_nothing_is_set_once_torch_is_loaded():
    code = ("import os, torch, mm_pipeline; from mm_pipeline.openmp_env import apply_defaults; "
            "print(os.environ.get('GOMP_SPINCOUNT'), apply_defaults())")
    assert seen_in_child(code) == "None None"
