"""Every benchmark starts as ``python benchmarks/NAME.py`` from any working directory, with or without
the repository on PYTHONPATH, and imports the packages of the repository it lives in.

The venv's editable install may map the packages to another checkout; its finder is asked only after
every ``sys.path`` entry, so a script that does not put its own repository first would silently run
that other checkout's code. ``python -v`` logs the file of every module it loads ("# code object from
PATH"): no package module may come from a checkout other than this one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.paths import REPO

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
PACKAGES = ("llm_core", "encoders", "mm_pipeline", "kernels", "samples")
TIMEOUT_S = 180  # torch (and for some scripts transformers) import on a busy 2-core machine
LOADED_PREFIX = "# code object from "

pytestmark = pytest.mark.slow


def _source_of(logged: str) -> Path:
    """The .py file behind a logged path (a cached ``__pycache__/NAME.cpython-XY.pyc`` included)."""
    path = Path(logged.strip().strip("'"))
    if path.parent.name == "__pycache__":
        return path.parent.parent / (path.name.split(".")[0] + ".py")
    return path


def _checkout_of(path: Path) -> Path | None:
    """The mmserve checkout a module file belongs to: the folder above its top package that holds a
    pyproject.toml; None for anything else (stdlib, site-packages)."""
    for folder in path.parents:
        if folder.name in PACKAGES and (folder.parent / "pyproject.toml").is_file():
            return folder.parent
    return None


def _imports_packages_at_top(script: Path) -> bool:
    """Whether the script's module level imports one of our packages (``--help`` then loads it)."""
    for node in ast.parse(script.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n.split(".")[0] in PACKAGES for n in names):
            return True
    return False


def test_every_script_is_covered() -> None:
    assert len(SCRIPTS) >= 7, SCRIPTS
    assert not {f"{p}.py" for p in PACKAGES} & set(SCRIPTS), "a benchmark named like a package shadows it"
    assert "pipeline.py" in SCRIPTS, "the PYTHONPATH case names a script that is gone"


# Every script runs without the repository on PYTHONPATH: the case where only the script's own
# bootstrap keeps the editable finder from serving another checkout. With PYTHONPATH set the repository
# is first on sys.path before the script runs, so one script there shows the bootstrap does no harm
# (each run is a torch import, ~5 s on the CI machine: every script twice cost over three minutes).
CASES = [(s, False) for s in SCRIPTS] + [("pipeline.py", True)]


def _start(script: str, with_pythonpath: bool, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_pythonpath:
        env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-v", str(BENCH / script), "--help"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> dict[tuple[str, bool], Future]:
    """Every case's ``--help`` run, two at a time: each is a torch import on one core, and the rest of
    the suite leaves the second core idle meanwhile (the runs are independent processes)."""
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {case: pool.submit(_start, *case, tmp_path_factory.mktemp("start")) for case in CASES}
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize(("script", "with_pythonpath"), CASES,
                         ids=[f"{s}-{'PYTHONPATH' if p else 'no-PYTHONPATH'}" for s, p in CASES])
def test_script_starts(script: str, with_pythonpath: bool, started) -> None:
    proc = started[(script, with_pythonpath)].result()
    log = proc.stderr.splitlines()
    errors = "\n".join(line for line in log if not line.startswith(("#", "import ", "  ")))
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}:\n{errors[-4000:]}"
    assert "usage:" in proc.stdout

    loaded = [_source_of(line[len(LOADED_PREFIX):]) for line in log if line.startswith(LOADED_PREFIX)]
    checkouts = {_checkout_of(p) for p in loaded} - {None}
    foreign = sorted(str(c) for c in checkouts - {REPO})
    assert not foreign, f"{script} imported packages from another checkout: {foreign}"
    if _imports_packages_at_top(BENCH / script):
        assert checkouts == {REPO}, f"{script} loaded none of this repository's packages"
    bootstrap = BENCH / "_bench_bootstrap.py"
    assert bootstrap in loaded, f"{script} does not import _bench_bootstrap"
    first_ours = next((i for i, p in enumerate(loaded) if _checkout_of(p) == REPO), len(loaded))
    assert loaded.index(bootstrap) < first_ours, f"{script} imports a package before _bench_bootstrap"
