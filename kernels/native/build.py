"""Compile, cache and load the C sources next to this file (``<name>.c`` -> a ctypes library).

The cache key is the source text (and the headers next to it), the compiler's identity, the flags and the host CPU's feature flags:
``-march=native`` code built on one machine may not run on another, so a cache directory shared between
machines (a home directory on NFS) still never hands one machine another's build. Builds go to a
temporary file renamed into place, so two processes compiling at once (a server and its test) never
load a half-written library. A failed build is logged once and remembered for the process: the callers
fall back to torch, they never see a compiler error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
ENV_SWITCH = "MMSERVE_NATIVE_KERNELS"  # "0": torch paths only
ENV_CACHE = "MMSERVE_NATIVE_CACHE"  # where built libraries go (default: ~/.cache/mmserve/native)
# -fno-trapping-math: no kernel reads the FP exception flags, and without it GCC keeps a loop with a
# float select (row_ops.h exp_approx's clamps) scalar: the experts' SiLU then called libm per element.
# It changes no value (IEEE results, NaN and signed zeros as before), only what the vectorizer may do.
BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-fno-trapping-math")
BUILD_TIMEOUT_S = 120.0

_enabled = os.environ.get(ENV_SWITCH, "1") != "0"
_loaded: dict[tuple[str, Path, tuple[str, ...]], ctypes.CDLL | None] = {}
_lock = threading.Lock()


def loaded_library(fragment: str) -> str | None:
    """The path of a shared object this process has mapped whose file name contains ``fragment``
    (``/proc/self/maps``; None when none is, or off Linux). Used to find torch's own OpenMP runtime
    and MKL (here, and mm_pipeline/runtime/cpu_threads/intra_op.py)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and fragment in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


@functools.cache  # the wrappers ask on every call; /proc/self/maps takes ~0.4 ms to read
def openmp_flags() -> tuple[str, ...]:
    """``("-fopenmp",)`` when torch's OpenMP runtime (libgomp) is loaded in this process, else ``()``.
    A library built with it names ``libgomp.so.1``, which the loader resolves to the copy already
    mapped (one runtime, so a kernel's parallel region is the calling thread's own team -- the
    engine thread's on a wide step, none at one thread); where torch uses another runtime or none
    the kernels stay serial rather than bring a second OpenMP runtime into the process."""
    if os.environ.get("MMSERVE_NATIVE_OPENMP", "1") == "0":
        return ()
    return ("-fopenmp",) if loaded_library("libgomp") else ()


def set_enabled(on: bool) -> None:
    """Turn the C kernels on or off for this process (the engine config's ``native_cpu_kernels``)."""
    global _enabled
    _enabled = bool(on) and os.environ.get(ENV_SWITCH, "1") != "0"


def enabled() -> bool:
    return _enabled


Signature = tuple[list, type | None]  # a C function's ctypes argtypes and restype


def library(name: str, *, flags: tuple[str, ...] = (), source_dir: Path | None = None,
            signatures: dict[str, Signature] | None = None) -> ctypes.CDLL | None:
    """The compiled ``<source_dir>/<name>.c`` (default: this package's folder), or None when the
    kernels are off, no C compiler is found or the build fails. Built once per process and cached on
    disk across processes. ``flags``: extra compiler flags of this source (e.g. ``-fopenmp``);
    ``signatures``: function name -> (argtypes, restype), declared once when the library loads."""
    if not _enabled:
        return None
    key = (name, source_dir or SOURCE_DIR, tuple(flags))
    if key in _loaded:  # built: no lock (a dict read is atomic), the wrappers ask on every layer call
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            lib = _loaded[key] = _build_and_load(name, key[1], key[2])
            for fn, (argtypes, restype) in (signatures or {}).items():
                if lib is not None:
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
        return _loaded[key]


def _build_and_load(name: str, source_dir: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    source = source_dir / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("native CPU kernels off: no C compiler found (install gcc or set CC); torch paths serve")
        return None
    try:
        # the headers next to the source (shared code such as small_gemm.h) are part of what it builds
        text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_dir.glob("*.h")))
        command = [compiler, *BASE_FLAGS, *flags]
        target = _cache_dir() / f"{name}-{_fingerprint(text, command)}.so"
        if not target.exists():
            _compile(command, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernel %s not built (%s); its torch path serves", name, e)
        return None


def _compile(command: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode:
            raise subprocess.SubprocessError(f"{command[0]} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmserve" / "native"


def _fingerprint(source: bytes, command: list[str]) -> str:
    h = hashlib.sha256(source)
    h.update("\0".join(command).encode())
    h.update(_compiler_version(command[0]).encode())
    h.update(platform.machine().encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:20]


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return compiler


def _cpu_flags() -> str:
    """The host CPU's model and feature flags (Linux /proc/cpuinfo; elsewhere the platform string)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.platform()
