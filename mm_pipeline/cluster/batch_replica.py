"""The batch replica: one engine per actor answering OpenAI Batch lines with the single-process
job's own code (``BatchJob.answer``), so ``mmserve batch --ray`` writes the lines ``mmserve batch``
writes."""

from __future__ import annotations

from typing import Any

import numpy as np

from mm_pipeline.cluster.job_replica import JobReplica, ReplicaSpec
from mm_pipeline.jobs.batch import BatchJob
from mm_pipeline.jobs.resume import RowKey
from mm_pipeline.server.batches.lines import (custom_id_of, decode_line, error_line, failure_message, line_key,
                                              parse_line)


def line_of(raw: Any) -> str | bytes:
    """An input line as the read stage sends it (its bytes) -> what ``input_lines`` gives for it:
    text, or the bytes of a line that is not UTF-8 (``parse_line`` makes that an error line)."""
    line = decode_line(bytes(raw))
    return "" if line is None else line  # never blank: the read stage passes blank lines over


class BatchReplica(JobReplica):
    """Batches of input lines (``number``, ``raw``: the line's bytes) -> OpenAI Batch output lines."""

    def __init__(self, spec: ReplicaSpec, default_max_tokens: int | None, reasoning_parser: str = "auto",
                 tool_call_parser: str = "auto") -> None:
        super().__init__(spec)
        self.job = BatchJob(self.engine, default_max_tokens=default_max_tokens, reasoning_parser=reasoning_parser,
                            tool_call_parser=tool_call_parser)

    def keys(self, batch: dict[str, np.ndarray]) -> list[RowKey | None]:
        # as the plan keys the lines: a retried batch skips a journaled line without a custom_id too
        return [line_key(int(n), line_of(raw)) for n, raw in zip(batch["number"], batch["raw"])]

    async def answer(self, batch: dict[str, np.ndarray], i: int, n: int) -> dict[str, Any]:
        return await self.job.answer(parse_line(int(batch["number"][i]), line_of(batch["raw"][i])))

    def crashed(self, batch: dict[str, np.ndarray], i: int, message: str) -> dict[str, Any]:
        number = int(batch["number"][i])
        row = error_line(custom_id_of(line_of(batch["raw"][i])), "replica_crashed", f"line {number}: {message}")
        row["error"]["line"] = number  # as every error row of a line: a line without a custom_id is known by it
        return row

    def outcome(self, row: dict[str, Any]) -> tuple[str | None, int]:
        body = (row.get("response") or {}).get("body") or {}
        return failure_message(row), int((body.get("usage") or {}).get("completion_tokens") or 0)
