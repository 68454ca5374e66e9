"""Constraints -> compiled grammars (xgrammar), one compiler per engine, any thread.

    GrammarCompiler.compile(params)   a cached CompiledGrammar, or a GrammarError naming the problem
        cache hit (LRU, bounded in entries and bytes)            microseconds
        miss: the compile worker process (worker.py)             milliseconds for ordinary schemas;
              killed past ``timeout_s`` (a GrammarError: the constraint is the client's)

The tokenizer's vocabulary is read once, on the first compile (xgrammar's ``TokenizerInfo``: each
token's bytes, the stop ids), and handed to the worker when it starts. One compile runs at a time:
the worker is one process with one thread, so a flood of distinct schemas queues rather than taking
the cores the model steps need; a compile that waits longer than ``timeout_s`` for its turn fails
the same way.

Why not xgrammar's in-process compiler with its own cache: a compile cannot be stopped once it runs
in a thread (worker.py's docstring has the 270 s schema), and its cache is unbounded by default.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from llm_core.engine.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding llm_core/
# the worker imports xgrammar (and with it torch): ~3 s on the 2-core host, not part of a compile's limit
WORKER_START_TIMEOUT_S = 120.0


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, over a bound, or too slow to compile (a 400)."""


class GrammarBusyError(GrammarError):
    """The compiler stayed busy with other constraints for the whole time limit: try again (a 429)."""


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer (module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *, timeout_s: float = 10.0,
                 cache_entries: int = 256, cache_bytes: int = 128 << 20) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.timeout_s = float(timeout_s)
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self._info = None  # xgrammar.TokenizerInfo, built on first use
        self._info_lock = threading.Lock()
        self._turn = threading.Lock()  # one compile at a time through the worker
        self._proc: subprocess.Popen | None = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_used = 0
        self._cache_lock = threading.Lock()
        self.counts = {"compiles": 0, "cache_hits": 0, "rejected": 0, "timeouts": 0, "worker_starts": 0}

    # ---- public API (any thread) --------------------------------------------------------------
    def tokenizer_info(self):
        """xgrammar's view of the vocabulary (built once)."""
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids))
            return self._info

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached); a ``GrammarError`` when it cannot be served."""
        key = params.compile_key
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.counts["cache_hits"] += 1
                return hit
        compiled = self._compile(key, params.name)
        with self._cache_lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_used += compiled.memory_size_bytes
                while self._cache and (len(self._cache) > self.cache_entries or self._cache_used > self.cache_bytes):
                    _, old = self._cache.popitem(last=False)
                    self._cache_used -= old.memory_size_bytes
            return self._cache.get(key, compiled)

    def close(self) -> None:
        """Stop the worker process (a later compile starts another)."""
        with self._turn:
            self._stop_worker()

    # ---- internal helpers ---------------------------------------------------------------------
    def _compile(self, key: tuple[str, str, bool], name: str):
        import xgrammar as xgr

        kind, text, no_ws = key
        if not self._turn.acquire(timeout=self.timeout_s):
            self.counts["timeouts"] += 1
            raise GrammarBusyError(f"the grammar compiler is busy (other constraints are compiling); waited "
                                   f"{self.timeout_s:g} s")
        try:
            proc = self._worker()  # its start (once) is not part of the compile's limit
            try:
                proc.stdin.write(json.dumps({"kind": kind, "text": text, "disable_any_whitespace": no_ws}) + "\n")
                proc.stdin.flush()
                line = self._read_line(proc, time.monotonic() + self.timeout_s)  # its full time once its turn came
            except (OSError, ValueError):
                line = None
            if line is None:
                timed_out = proc.poll() is None
                self._stop_worker()
                if timed_out:
                    self.counts["timeouts"] += 1
                    raise GrammarError(f"{name} took longer than {self.timeout_s:g} s to compile; "
                                       f"simplify it (e.g. smaller repetition counts)")
                raise GrammarError(f"the grammar compiler failed on this {name} "
                                   f"(worker exit code {proc.returncode})")
            self.counts["compiles"] += 1
        finally:
            self._turn.release()
        answer = json.loads(line)
        if "error" in answer:
            self.counts["rejected"] += 1
            raise GrammarError(f"invalid {name}: {answer['error']}")
        return xgr.CompiledGrammar.deserialize_json(answer["grammar"], self.tokenizer_info())

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> str | None:
        """The worker's next answer line, or None (past ``deadline``, or the worker died)."""
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
        if not ready:
            return None
        line = proc.stdout.readline()  # the whole line follows: the worker writes it at once, then flushes
        return line or None

    def _worker(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        info = self.tokenizer_info().serialize_json()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen([sys.executable, "-m", "llm_core.engine.structured.worker"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1 << 16)
        self.counts["worker_starts"] += 1
        try:
            self._proc.stdin.write(json.dumps({"tokenizer_info": info}) + "\n")
            self._proc.stdin.flush()
            ready = self._read_line(self._proc, time.monotonic() + WORKER_START_TIMEOUT_S)
        except (OSError, ValueError):
            ready = None
        if ready is None:
            self._stop_worker()
            raise GrammarError("the grammar compile worker did not start (is xgrammar installed?)")
        return self._proc

    def _stop_worker(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
