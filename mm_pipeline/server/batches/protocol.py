"""The bodies of OpenAI's Batch API: what ``client.batches.create(...)`` sends, and the batch object
every route answers with (``object: "batch"``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mm_pipeline.server.batches.lines import URLS
from mm_pipeline.server.responses import ListPage

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
FINISHED = ("failed", "completed", "expired", "cancelled")
WINDOW_S = 24 * 3600  # OpenAI's one completion window, "24h"
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal[tuple(URLS)]  # type: ignore[valid-type]
    completion_window: Literal["24h"]
    metadata: dict[str, Any] | None = Field(default=None, max_length=METADATA_PAIRS)

    @field_validator("metadata")
    @classmethod
    def _metadata_is_short_strings(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's rules, which bound what a kept batch holds: keys of at most 64 characters,
        values strings of at most 512. Checked here rather than by the type, so a message names
        the rule and never quotes a long key."""
        for key, value in (metadata or {}).items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"keys are strings of at most {METADATA_KEY_CHARS} characters, one has {len(key)}")
            if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"the value of {key!r} must be a string of at most {METADATA_VALUE_CHARS} characters")
        return metadata


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, Any] | None = None

    def mark(self, status: BatchStatus) -> None:
        """Enter ``status``, stamping its time (``<status>_at``)."""
        self.status = status
        stamp = f"{status}_at"
        if stamp in type(self).model_fields:
            setattr(self, stamp, int(time.time()))

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


class BatchList(ListPage):
    data: list[BatchObject]
