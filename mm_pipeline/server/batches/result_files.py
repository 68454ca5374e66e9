"""ResultFiles: a running batch's output and error files, written as its lines are answered and
committed to the file store at the end (purpose batch_output), as OpenAI splits them: lines answered
200 in the output file, the rest (error answers, lines never run) in the error file. The batch's
request_counts follow every line written."""

from __future__ import annotations

import json
from typing import Any, Iterator

from mm_pipeline.server.batches.lines import LineTooLong, custom_id_of, error_line, failure_message
from mm_pipeline.server.batches.protocol import BatchObject
from mm_pipeline.server.files.files_store import FilesStore


class ResultFiles:
    def __init__(self, files: FilesStore, batch: BatchObject) -> None:
        self.files, self.batch = files, batch
        self._out = {"output": files.begin_upload(f"{batch.id}_output.jsonl", "batch_output"),
                     "error": files.begin_upload(f"{batch.id}_error.jsonl", "batch_output")}

    def write(self, rec: dict[str, Any]) -> None:
        """One output line: to the output file if it was answered (200), else to the error file."""
        failed = failure_message(rec) is not None
        try:
            line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        except UnicodeEncodeError:  # a lone surrogate (lines refuse them): escaped as its input had it
            line = (json.dumps(rec) + "\n").encode()
        self._out["error" if failed else "output"].write(line)
        counts = self.batch.request_counts
        counts.failed += failed
        counts.completed += not failed

    def expired(self, custom_id: str | None) -> None:
        """The error line of a line never run because the batch's window ended (OpenAI's code)."""
        self.write(error_line(custom_id, "batch_expired", "this request could not be executed before the "
                                                          "completion window expired"))

    def expire_rest(self, lines: Iterator[tuple[int, str | bytes | LineTooLong]]) -> int:
        """On a thread: a ``batch_expired`` error line for each line left unread -- after the last line
        in flight (none when the file was read to its end), or every line of a batch that expired
        before it started."""
        count = 0
        for _, raw in lines:
            self.expired(custom_id_of(raw))
            count += 1
        return count

    def commit(self) -> dict[str, str | None]:
        """The written files' ids (None for one nothing was written to: it is not kept). When one
        cannot be committed (the store is full), the ones committed before it are deleted: the
        batch fails naming no file, so a file left behind would be found by no one and count
        against the quota. On a thread: it moves files."""
        ids: dict[str, str | None] = {}
        try:
            for name, writer in self._out.items():
                if writer.nbytes:
                    ids[name] = writer.commit().id
                else:
                    writer.discard()
                    ids[name] = None
        except BaseException:
            for file_id in filter(None, ids.values()):
                self.files.delete(file_id)
            raise
        return ids

    def discard(self) -> None:
        """Drop what was written (the batch failed or the server is shutting down)."""
        for writer in self._out.values():
            writer.discard()
