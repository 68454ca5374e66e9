"""``mmserve caption``: caption many media files with one engine, concurrently, resumably.

    inputs (files, dirs, globs, .txt/.jsonl lists) ─► discover_inputs ─► [paths]
    CaptionJob.run(paths):  skip paths already in the output (resume)
        up to ``concurrency`` items in flight ─► read bytes, sniff modality, hash (thread;
            jobs/media_input.py) ─► CaptionJob.caption_input: engine.generate([media part, prompt])
            ─► one JSONL line per input (flushed)

``caption_input`` builds the row; the Ray job (mm_pipeline/cluster/) calls it on its replicas, so
both paths write the same rows.

Every input gets a line, failures included (``error`` names the problem, ``caption`` is null), so
a re-run only retries what is missing.  Many items in flight at once is what lets the engine batch
the encoders and the decode steps; the output order is completion order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.errors import generation_error
from mm_pipeline.jobs.media_input import MediaInput, error_text, read_media_input
from mm_pipeline.jobs.progress import FAILURES_SHOWN, Progress
from mm_pipeline.jobs.replica_stats import ReplicaStats
from mm_pipeline.jobs.resume import done_keys, open_output
from mm_pipeline.media.types import MediaKind
from mm_pipeline.runtime.stats import OmniStats

DEFAULT_PROMPTS = {MediaKind.IMAGE: "Describe this image.", MediaKind.VIDEO: "Describe this video.",
                   MediaKind.AUDIO: "Describe this audio."}
LIST_SUFFIXES = {".txt", ".list", ".lst", ".jsonl"}
# Directory scans skip these: they are metadata next to media (labels, manifests), not media.
_NOT_MEDIA = {".txt", ".json", ".jsonl", ".md", ".csv", ".tsv", ".yaml", ".yml", ".py"}


# ---- input discovery ----------------------------------------------------------------------------
def _read_list(path: Path) -> list[str]:
    """Paths named by a text list (one per line, # comments) or JSONL (a string or an object with
    "input" / "path" / "file" per line); relative paths are relative to the list's directory.
    Read a line at a time, split on "\n" only ("\r\n" works, a last line may lack its newline):
    U+2028 or U+0085 belong to a name (or a JSON string), where ``str.splitlines`` would cut the line."""
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):  # binary-mode iteration splits on b"\n" only
            # bytes that are not UTF-8 decode as os.fsdecode does: the name os.walk would give the file
            line = raw.decode("utf-8", "surrogateescape").strip()
            if not line or line.startswith("#"):
                continue
            if path.suffix.lower() == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
                except RecursionError:  # nested deeper than the parser goes: no list line is that
                    raise ValueError(f"{path}:{n}: not JSON (nested too deeply)") from None
                item = obj if isinstance(obj, str) else next(
                    (obj[k] for k in ("input", "path", "file") if isinstance(obj, dict) and k in obj), None)
                if not isinstance(item, str):
                    raise ValueError(f"{path}:{n}: expected a path string or an object with 'input'/'path'/'file'")
                line = item
            p = Path(line).expanduser()
            out.append(str(p if p.is_absolute() else path.parent / p))
    return out


def _walk(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and Path(name).suffix.lower() not in _NOT_MEDIA:
                found.append(str(Path(dirpath) / name))
    return found


def discover_inputs(specs: list[str]) -> list[str]:
    """Expand CLI inputs into media paths (order kept, duplicates dropped).  A directory is walked
    recursively, a ``.txt``/``.jsonl`` file is a list of paths, a pattern with ``*?[`` is a glob;
    anything else is one input (a missing file still becomes an input, reported as failed, and so
    does a pattern that matches no file: it may be a missing file whose name has ``[``)."""
    seen: dict[str, None] = {}
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_dir():
            items = _walk(p)
        elif p.is_file() and p.suffix.lower() in LIST_SUFFIXES:
            items = _read_list(p)
        elif not p.exists() and any(c in spec for c in "*?["):
            items = sorted(q for q in glob.glob(str(p), recursive=True) if Path(q).is_file()) or [str(p)]
        else:
            items = [str(p)]
        for item in items:
            seen.setdefault(item, None)
    return list(seen)


def already_done(out_path: Path) -> set[str]:
    """Inputs with a line in an existing output (a torn last line from a crash is ignored)."""
    return done_keys(out_path, "input")


# ---- the job ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptionConfig:
    prompt: str | None = None  # None: the default prompt of the detected modality
    max_tokens: int = 64
    temperature: float = 0.0
    concurrency: int = 32

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        # the engine's rules for max_tokens and temperature, checked now: a bad value would fail
        # every input, and the resumed job would then skip them all
        SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)


@dataclass
class CaptionSummary:
    total: int = 0
    skipped: int = 0  # already in the output (resumed run)
    succeeded: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    completion_tokens: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # the first FAILURES_SHOWN
    cache: dict[str, Any] = field(default_factory=dict)
    replicas: list[ReplicaStats] = field(default_factory=list)  # the Ray job's replicas (else empty)

    def add(self, path: str, error: str | None, completion_tokens: int) -> None:
        """Count one finished input (both caption paths: one process, or rows from Ray replicas)."""
        if error is None:
            self.succeeded += 1
            self.completion_tokens += completion_tokens
        else:
            self.failed += 1
            if len(self.failures) < FAILURES_SHOWN:  # the ones the summary names; the rest are counted
                self.failures.append((path, error))

    @property
    def items_per_s(self) -> float:
        return (self.succeeded + self.failed) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def lines(self) -> list[str]:
        out = [f"captioned {self.succeeded} of {self.total - self.skipped} inputs in {self.elapsed_s:.2f} s "
               f"({self.items_per_s:.2f} items/s, {self.completion_tokens} tokens)"
               + (f"; {self.skipped} already in the output were skipped" if self.skipped else "")]
        if self.cache:
            out.append("cache hits: " + ", ".join(f"{k}={v}" for k, v in sorted(self.cache.items())))
        out += ReplicaStats.table(self.replicas)
        if self.failures:
            out.append(f"{self.failed} failed:")
            out += [f"  {path}: {err}" for path, err in self.failures]
            if self.failed > len(self.failures):
                out.append(f"  ... and {self.failed - len(self.failures)} more")
        return out


class CaptionJob:
    """Captions inputs through an engine with the ``OmniEngine`` API; writes JSONL as it goes."""

    def __init__(self, engine: Any, config: CaptionConfig | None = None) -> None:
        self.engine = engine
        self.config = config or CaptionConfig()
        self._media: dict[str, tuple[bytes, str]] = {}  # file id -> (bytes, path), for the engine's file resolver
        self._defaults = getattr(engine, "generation_defaults", None) or GenerationDefaults()
        # the engine's byte limit of one media item (--media-max-bytes): a bigger input is refused
        # before it is read, not read whole and then refused by the engine
        self._max_bytes = getattr(getattr(getattr(engine, "config", None), "limits", None), "max_bytes", None)
        # the engine reads an input's bytes as a file part; its errors name the input's path (a
        # corrupt image is "image from local file '/data/a.jpg' cannot be read", not "from upload")
        engine.set_file_resolver(self._resolve, local_files=True)

    async def run(self, inputs: list[str], out_path: str | Path, progress: Progress | None = None,
                  on_record: Callable[[dict], None] | None = None) -> CaptionSummary:
        out_path = Path(out_path)
        with open_output(out_path) as out:  # locked for the run: done rows are read under the lock
            done = already_done(out_path)
            todo = [p for p in inputs if p not in done]
            summary = CaptionSummary(total=len(inputs), skipped=len(inputs) - len(todo))
            cache_before = cache_hits(self.engine)
            start = time.perf_counter()
            pending = iter(enumerate(todo))  # shared by the workers: at most `concurrency` items in flight

            async def worker() -> None:
                for n, path in pending:
                    rec = await self._caption(n, path)
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    out.flush()
                    summary.add(path, rec["error"], rec["completion_tokens"])
                    if progress is not None:
                        progress.advance(1, failed=int(rec["error"] is not None))
                    if on_record is not None:
                        on_record(rec)

            await asyncio.gather(*(worker() for _ in range(min(self.config.concurrency, len(todo)))))
        summary.elapsed_s = time.perf_counter() - start
        summary.cache = {k: v - cache_before.get(k, 0) for k, v in cache_hits(self.engine).items()}
        return summary

    async def _caption(self, n: int, path: str) -> dict[str, Any]:
        return await self.caption_input(n, await asyncio.to_thread(read_media_input, path, max_bytes=self._max_bytes))

    async def caption_input(self, n: int, item: MediaInput) -> dict[str, Any]:
        """The output row of one read input (``n``: unique among the inputs in flight).  Never
        raises: an input that cannot be read or captioned gets ``error`` and ``caption: null``."""
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"input": item.path, "modality": item.kind.value if item.kind else None,
                               "caption": None, "error": item.error, "content_hash": item.content_hash,
                               "prompt_tokens": 0, "completion_tokens": 0, "timings": {}}
        if item.error is not None:
            rec["timings"] = {"total_s": round(item.read_s, 4)}
            return rec
        file_id = f"caption-{n}"
        try:
            self._media[file_id] = (item.data, item.path)
            prompt = self.config.prompt or DEFAULT_PROMPTS[item.kind]
            messages = [{"role": "user", "content": [{"type": "file", "file": {"file_id": file_id}},
                                                     {"type": "text", "text": prompt}]}]
            # the job's own length and temperature (greedy by default: a caption is reproducible)
            # over the model's generation config (top_p, top_k, min_p, repetition_penalty), as served
            params = dataclasses.replace(self._defaults.sampling_params(), max_tokens=self.config.max_tokens,
                                         temperature=self.config.temperature)
            text, first = "", None
            async for d in self.engine.generate(messages, params, request_id=f"caption-{n}-{os.getpid()}"):
                if first is None and d.new_token_ids:
                    first = time.perf_counter()
                text += d.new_text or ""
                rec["prompt_tokens"], rec["completion_tokens"] = d.prompt_tokens, d.completion_tokens
                error = generation_error(d.finish_reason, d.error_kind, d.error) if d.finished else None
                if error is not None:
                    raise error
            rec["caption"] = text.strip()
            rec["timings"] = {"read_s": round(item.read_s, 4),
                              "first_token_s": round((first or time.perf_counter()) - t0 + item.read_s, 4),
                              "total_s": round(time.perf_counter() - t0 + item.read_s, 4)}
        except Exception as exc:  # one bad input must not stop the job
            rec["error"] = error_text(exc)
            rec["timings"] = {"total_s": round(time.perf_counter() - t0 + item.read_s, 4)}
        finally:
            self._media.pop(file_id, None)
        return rec

    def _resolve(self, file_id: str) -> tuple[bytes, str | None]:
        try:
            return self._media[file_id]
        except KeyError:
            raise KeyError(f"caption job has no media for file id {file_id!r}") from None


def cache_hits(engine: Any) -> dict[str, int]:
    """``{"<metric>.<tier>": n}`` from the engine's stats snapshot: encoder cache hits and prefix
    cache hit tokens per tier, under their /metrics names."""
    s = engine.stats()
    if not isinstance(s, OmniStats):
        return {}
    hits = {f"encoder_cache_hits.{tier}": n for tier, n in s.encoder_cache_hits.items()}
    hits.update({f"prefix_cache_hit_tokens.{tier}": n for tier, n in s.llm.prefix_cache_hit_tokens.items()})
    return hits
