"""How long an idle OpenMP team thread spins before it sleeps: set for libgomp before it loads.

libgomp (the OpenMP runtime torch's CPU ops and MKL run on) lets a team thread whose parallel region
ended spin for ``GOMP_SPINCOUNT`` iterations -- 300,000 by default, ~10 ms of a core on the 2-core
host -- before it sleeps on a futex, so that the next region starts without a wake-up. Inside a
long step the next region is microseconds away and the spin pays. After the step it is a core taken
from everything that runs next -- the event loop delivering the token, the next request's prompt
layout on a worker, decode workers and encoder lanes -- on a host with two cores, half of it. The
engine thread owns the one wide team (runtime/cpu_threads/thread_choice.py) and uses it only for long steps, so
those 10 ms follow every long step. With 20,000 spins the team stops after ~1 ms of a core
(benchmarks/intra_op_threads.py measures both), long enough to bridge the gaps between the ops of a
step (tens of microseconds), short enough to free the core right after it.

libgomp reads the variable once, when it loads (with ``import torch``), so this module sets the
default from ``mm_pipeline/__init__.py`` -- the first thing ``mmserve`` imports -- and only while
torch is not loaded yet; a value already in the environment (the user's) is kept, and so is
libgomp's own behaviour for a user who chose ``OMP_WAIT_POLICY`` (PASSIVE sleeps at once, ACTIVE spins
for good: a spin count of ours would override either).
"""

from __future__ import annotations

import os
import sys

SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = 20_000
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def apply_defaults() -> str | None:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless it or ``OMP_WAIT_POLICY`` is set, or torch
    is already loaded (the runtime would never read it). Returns the spin count the OpenMP runtime
    sees (None: its own default)."""
    if "torch" in sys.modules or WAIT_POLICY_ENV in os.environ:
        return os.environ.get(SPIN_ENV)
    return os.environ.setdefault(SPIN_ENV, str(SPIN_COUNT))
