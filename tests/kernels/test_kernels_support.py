"""Where the Triton kernel tests run, and the child process that runs them on CPU.

``triton.jit`` decides at import time whether a kernel is compiled or interpreted, and
TRITON_INTERPRET=1 in the main pytest process would turn every later kernel into the (slow, CPU)
interpreter -- including on a GPU machine. So on a machine without CUDA each kernel test file
re-runs *itself* in a child pytest with TRITON_INTERPRET=1; on CUDA the tests run in place on the GPU:

    parent (no CUDA):  kernel tests deselected here  +  test_under_interpreter -> child pytest <file>
    child:             kernel tests run on CPU tensors through the interpreter; test_under_interpreter
                       deselected
    parent (CUDA):     kernel tests run on CUDA tensors; test_under_interpreter deselected

Two markers say which side a test belongs to, and tests/conftest.py deselects (rather than skips)
the side this process does not run, so a CPU run shows no skips for tests that did run in the child:
``kernel_test`` (``triton_kernel``) on kernel tests, ``interpreter_rerun`` on test_under_interpreter.
A failure in the child fails the parent's test_under_interpreter with the child's output.

Helpers shared by the kernel test files live here too (imported as ``test_kernels_support``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

IN_CHILD = os.environ.get("MMSERVE_KERNEL_CHILD") == "1"
ON_CUDA = torch.cuda.is_available() and not IN_CHILD
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
RUNS_HERE = ON_CUDA or IN_CHILD
from tests.support.paths import REPO  # noqa: E402

kernel_test = pytest.mark.triton_kernel  # runs here when RUNS_HERE, else only in the child
interpreter_rerun = pytest.mark.interpreter_rerun  # the parent's re-run of a file in the child

if IN_CHILD:
    from kernels import ops
    from tests.support.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()  # numpy >= 2.4 and bf16-dot gaps of triton 3.6's interpreter
    ops.force_triton(True)


def run_under_interpreter(test_file: str, config: pytest.Config, timeout: float = 300.0) -> None:
    """Run ``test_file`` in a child pytest with TRITON_INTERPRET=1; fail with its output on error."""
    if RUNS_HERE:  # conftest deselects the caller here; guard against a child starting a child
        pytest.skip("kernel tests already run in this process")
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider"]
    markexpr = config.getoption("markexpr", "")
    if markexpr:
        cmd += ["-m", markexpr]
    env = dict(os.environ, TRITON_INTERPRET="1", MMSERVE_KERNEL_CHILD="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    # pytest exit code 5 = nothing collected (e.g. every test deselected by -m): not a failure.
    if proc.returncode not in (0, 5):
        pytest.fail(f"interpreter run of {test_file} failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}"
                    f"\n{proc.stderr[-3000:]}", pytrace=False)


def paged_layout(
    gen: torch.Generator, seq_lens: list[int], page_size: int, window: int | None, new_tokens: list[int]
) -> tuple[torch.Tensor, int, list[tuple[int, int]]]:
    """Random page tables for requests (physical pages shuffled across requests) -> (table, num_pages,
    visible key ranges). With a window, pages wholly behind every query's window are released (-1)
    as the engine's SWA pool does; pages that straddle the window edge stay mapped."""
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 2  # two spare pages never mapped
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = max(pages_per_req + [1])
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int64)
    ranges = []
    nxt = 0
    for b, (n, new) in enumerate(zip(seq_lens, new_tokens)):
        first = 0 if window is None else max(0, n - new - window + 1)
        ranges.append((first, n))
        for p in range(pages_per_req[b]):
            if (p + 1) * page_size > first:  # page holds a key some query may still see
                table[b, p] = perm[nxt]
            nxt += 1
    return table, num_pages, ranges


def poison_invisible(cache: torch.Tensor, table: torch.Tensor, ranges: list[tuple[int, int]], page_size: int) -> None:
    """NaN every slot no query may read, so a kernel that reads outside the window shows NaN."""
    keep = torch.zeros(cache.shape[0], dtype=torch.bool)
    for b, (first, last) in enumerate(ranges):
        pos = torch.arange(first, last)
        keep[table[b, pos // page_size] * page_size + pos % page_size] = True
    cache[~keep] = float("nan")


def test_child_process_flags_are_consistent() -> None:
    # The child must never also think it is on CUDA, or it would run the interpreter on GPU tensors.
    assert not (IN_CHILD and ON_CUDA)
    assert RUNS_HERE == (IN_CHILD or torch.cuda.is_available())


def test_paged_layout_releases_only_pages_behind_the_window() -> None:
    gen = torch.Generator().manual_seed(0)
    table, num_pages, ranges = paged_layout(gen, [10, 3], page_size=4, window=3, new_tokens=[1, 3])
    # request 0: queries at position 9 see keys 7..9 -> pages 0 (0-3) released, 1 (4-7) straddles, 2 kept
    row = table[0].tolist()
    assert row[0] == -1 and min(row[1:3]) >= 0
    assert ranges == [(7, 10), (0, 3)]
    mapped = table[table >= 0].tolist()
    assert len(set(mapped)) == len(mapped) and max(mapped) < num_pages


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs a process without the interpreter")
def test_forcing_triton_on_cpu_without_interpreter_names_the_problem() -> None:
    from kernels import ops

    k_cache, v_cache = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    ops.force_triton(True)
    try:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            ops.store_kv(k_cache, v_cache, torch.tensor([1]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    finally:
        ops.force_triton(False)
    ops.store_kv(k_cache, v_cache, torch.tensor([1]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))  # reference path
    assert k_cache[1].sum().item() == 2 and k_cache.sum().item() == 2
