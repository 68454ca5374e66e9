"""``mmserve batch -i requests.jsonl -o results.jsonl``: OpenAI Batch files, run offline.

The lines' format -- input, output, the errors a line gets -- is the server's
(mm_pipeline/server/batches/lines.py, which ``/v1/batches`` reads too). Lines already in the output
are skipped, so an interrupted run resumes: a line by its custom_id, a line without one (not JSON, no
custom_id) by its line number, which its error row names (``error.line``). A broken line gets its
error line and the rest of the file runs. Lines that share a custom_id are refused before any runs
(as ``/v1/batches`` validation refuses them): one row could not tell which of them is done.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.jobs.resume import done_keys, open_output
from mm_pipeline.jobs.progress import FAILURES_SHOWN, Progress
from mm_pipeline.jobs.replica_stats import ReplicaStats
from mm_pipeline.server.batches.lines import (BatchLine, answer_line, failure_message, input_lines, parse_line,
                                              retry_overloaded)
from mm_pipeline.server.batches.validation import CustomIds
from mm_pipeline.server.completions.chat_service import ChatService, ServiceConfig
from mm_pipeline.prompt.reasoning import REASONING_PARSERS, resolve_reasoning
from mm_pipeline.prompt.tool_calls import TOOL_PARSERS, resolve_tool_calls

@dataclass
class BatchSummary:
    total: int = 0
    skipped: int = 0
    succeeded: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    failures: list[tuple[str | None, str]] = field(default_factory=list)  # the first FAILURES_SHOWN
    replicas: list[ReplicaStats] = field(default_factory=list)  # the Ray job's replicas (else empty)

    def add(self, custom_id: str | None, error: str | None) -> None:
        """Count one answered line (``error``: see ``failure_message``).  Only the failures the
        summary names are kept: a file of millions of failing lines must not keep them all."""
        if error is None:
            self.succeeded += 1
        else:
            self.failed += 1
            if len(self.failures) < FAILURES_SHOWN:
                self.failures.append((custom_id, error))

    def lines(self) -> list[str]:
        rate = (self.succeeded + self.failed) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        out = [f"batch: {self.succeeded} succeeded, {self.failed} failed of {self.total - self.skipped} "
               f"requests in {self.elapsed_s:.2f} s ({rate:.2f} req/s)"
               + (f"; {self.skipped} already in the output were skipped" if self.skipped else "")]
        out += ReplicaStats.table(self.replicas)
        out += [f"  {cid}: {msg}" for cid, msg in self.failures]
        if self.failed > len(self.failures):
            out.append(f"  ... and {self.failed - len(self.failures)} more")
        return out


@dataclass(frozen=True)
class BatchConfig:
    concurrency: int = 32  # lines in flight (the engine batches them)
    default_max_tokens: int | None = None  # of a request without max_tokens; None: the model's max_new_tokens, else 512
    # as `mmserve serve --reasoning-parser` (prompt/reasoning.py): a batch line's chat answer is the
    # one the server would give for it
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"  # as `mmserve serve --tool-call-parser` (prompt/tool_calls.py)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        try:  # the engine's rule, checked now: a bad default would fail every line without max_tokens
            if self.default_max_tokens is not None:
                SamplingParams(max_tokens=self.default_max_tokens)
        except ValueError as exc:
            raise ValueError(f"default_{exc}") from None  # "max_tokens must be ..." names the field
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")


class DuplicateCustomIdError(ValueError):
    """Two lines of a batch file share a custom_id (the message names it and both lines)."""


def done_lines(out_path: Path) -> tuple[set[str], set[int]]:
    """What the output ``out_path`` already answers: the custom_ids of its rows, and the input line
    numbers (``error.line``) of its rows without one.  Streamed: memory for the keys, not the rows."""
    ids: set[str] = set()
    numbers: set[int] = set()
    for k in done_keys(out_path, "custom_id"):  # resume.row_key: the rule --ray keys rows by too
        (ids if isinstance(k, str) else numbers).add(k)
    return ids, numbers


class BatchJob:
    """Runs an OpenAI batch file through a ``ChatService`` over the engine."""

    def __init__(self, engine: Any, concurrency: int = 32, default_max_tokens: int | None = None,
                 reasoning_parser: str = "auto", tool_call_parser: str = "auto") -> None:
        config = BatchConfig(concurrency, default_max_tokens, reasoning_parser, tool_call_parser)
        reasoning = resolve_reasoning(config.reasoning_parser, getattr(engine, "tokenizer", None))
        tool_calls = resolve_tool_calls(config.tool_call_parser, getattr(engine, "tokenizer", None))
        self.service = ChatService(engine, ServiceConfig(getattr(engine, "model_name", "mmserve"),
                                                         config.default_max_tokens, reasoning=reasoning,
                                                         tool_calls=tool_calls))
        self.concurrency = config.concurrency

    async def run(self, in_path: str | Path, out_path: str | Path, progress_stream=None) -> BatchSummary:
        in_path, out_path = Path(in_path), Path(out_path)
        with open_output(out_path) as out:  # locked for the run: done lines are read under the lock
            done_ids, done_numbers = done_lines(out_path)

            def done(n: int, cid: str | None) -> bool:
                # by its line number too when it has an id: a line whose id this quick read finds but
                # the full parse refuses (a lone surrogate escape) got an error row without the id
                return n in done_numbers or (cid is not None and cid in done_ids)

            total = skipped = 0
            ids = CustomIds()
            for n, _, cid in input_lines(in_path):  # a cheap first pass: duplicates, the progress total
                if (dup := ids.duplicate(n, cid)) is not None:
                    raise DuplicateCustomIdError(dup)
                total += 1
                skipped += int(done(n, cid))
            del ids
            summary = BatchSummary(total=total, skipped=skipped)
            progress = Progress(total - skipped, "batch", stream=progress_stream)
            # lines are parsed as workers take them: only `concurrency` request bodies live at once
            pending = (parse_line(n, raw) for n, raw, cid in input_lines(in_path) if not done(n, cid))
            start = time.perf_counter()

            async def worker() -> None:
                for line in pending:
                    rec = await self.answer(line)
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    out.flush()
                    error = failure_message(rec)
                    summary.add(line.custom_id, error)
                    progress.advance(1, failed=int(error is not None))

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        progress.close()
        summary.elapsed_s = time.perf_counter() - start
        return summary

    async def answer(self, line: BatchLine) -> dict[str, Any]:
        """The output line of one input line (both batch paths: one process, or a Ray replica). A
        line the engine has no room for right now (this job's own lines fill its queue: n choices
        each) waits and is sent again, as the server's /v1/batches does, not written as a 429."""
        return await answer_line(self.service, line, retry_overloaded())
