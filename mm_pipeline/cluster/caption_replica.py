"""The captioning replica: one engine per actor, rows built by the single-process job's own code
(``CaptionJob.caption_input``), so ``--ray`` writes exactly the rows ``mmserve caption`` writes."""

from __future__ import annotations

from typing import Any

import numpy as np

from mm_pipeline.cluster.job_replica import JobReplica, ReplicaSpec
from mm_pipeline.jobs.caption import CaptionConfig, CaptionJob
from mm_pipeline.jobs.media_input import MediaInput
from mm_pipeline.media.types import MediaKind


class CaptionReplica(JobReplica):
    """Batches of read inputs (``input``, ``data``, ``kind``, ``content_hash``, ``read_s``,
    ``read_error``: the columns of caption_dataset's read stage) -> caption rows."""

    def __init__(self, spec: ReplicaSpec, caption: CaptionConfig) -> None:
        super().__init__(spec)
        self.job = CaptionJob(self.engine, caption)

    def keys(self, batch: dict[str, np.ndarray]) -> list[str | None]:
        return [str(p) for p in batch["input"]]

    async def answer(self, batch: dict[str, np.ndarray], i: int, n: int) -> dict[str, Any]:
        error = batch["read_error"][i] or None
        kind = batch["kind"][i]
        item = MediaInput(path=str(batch["input"][i]), data=None if error else bytes(batch["data"][i]),
                          kind=MediaKind(kind) if kind else None, content_hash=batch["content_hash"][i] or None,
                          read_s=float(batch["read_s"][i]), error=error)
        return await self.job.caption_input(n, item)

    def crashed(self, batch: dict[str, np.ndarray], i: int, message: str) -> dict[str, Any]:
        kind = batch["kind"][i]
        return {"input": str(batch["input"][i]), "modality": MediaKind(kind).value if kind else None,
                "caption": None, "error": f"ReplicaCrashed: {message}",
                "content_hash": batch["content_hash"][i] or None, "prompt_tokens": 0, "completion_tokens": 0,
                "timings": {}}

    def outcome(self, row: dict[str, Any]) -> tuple[str | None, int]:
        return row.get("error"), int(row.get("completion_tokens") or 0)
