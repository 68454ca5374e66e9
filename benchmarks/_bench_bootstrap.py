"""Import first in every benchmark script: puts the root of the repository this file lives in at the
head of ``sys.path``.

``python benchmarks/NAME.py`` starts with the script's folder as ``sys.path[0]``; the packages
(``llm_core``, ``encoders``, ...) sit one level up. With the root first:

* the script runs with or without the repository on ``PYTHONPATH``, from any working directory;
* the packages come from *this* checkout, not from another one an editable install points at
  (a finder on ``sys.meta_path`` is only asked after every ``sys.path`` entry);
* no file in ``benchmarks/`` can shadow a package, since the root is searched before this folder.

The module's name is one no package or installed distribution uses; it must stay importable as a
top-level module from this folder, so it cannot live in a package.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _same(entry: str) -> bool:
    return bool(entry) and os.path.realpath(entry) == ROOT


sys.path[:] = [ROOT] + [p for p in sys.path if not _same(p)]

# mmserve's OpenMP defaults, set before a benchmark imports torch, so benchmarks run as `mmserve`
# does (mm_pipeline/openmp_env.py; a value already in the environment is kept).
import mm_pipeline  # noqa: E402,F401
