"""How a batch ends when an error that is no line's stops it: ``failed``, naming what happened in
words a client may read, the details (paths, class names, the traceback) only in the log."""

from __future__ import annotations

import logging

from mm_pipeline.server.batches.protocol import BatchError, BatchErrors, BatchObject
from mm_pipeline.server.files.files_store import FileNotFoundInStore, UploadTooLarge

# a failure is the batch worker's record: under the runner's logger, beside the rest of its batches' story
log = logging.getLogger("mm_pipeline.server.batches.runner")


def fail_batch(batch: BatchObject, exc: Exception) -> None:
    """A batch ended by an error that is no line's (a bug, a full store, its input deleted as the
    batch was created): ``failed``, naming what happened (paths and class names go to the log)."""
    cause = first_error(exc)
    if isinstance(cause, (FileNotFoundInStore, FileNotFoundError)):  # deleted while the batch was created
        log.info("batch %s failed: its input file %s is gone", batch.id, batch.input_file_id)
        what = f"the input file {batch.input_file_id} was deleted before the batch read it"
    else:
        log.error("batch %s failed", batch.id, exc_info=exc)
        if isinstance(cause, UploadTooLarge):  # the store's own words: which limit the results passed
            what = f"the results do not fit the file store: {cause}"
        elif isinstance(cause, OSError):
            what = f"a storage error ended the batch ({cause.strerror or type(cause).__name__})"
        else:
            what = f"an internal error ended the batch (logged as batch {batch.id})"
    batch.errors = BatchErrors(data=[BatchError(code="batch_failed", message=what)])
    batch.mark("failed")


def first_error(exc: BaseException) -> BaseException:
    """The error inside a TaskGroup's ExceptionGroup (its first): what a failed batch names."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
