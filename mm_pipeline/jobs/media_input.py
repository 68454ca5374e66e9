"""One caption input read from storage: its bytes, modality, content hash -- or why it cannot be read.

Both caption paths read inputs with :func:`read_media_input`: the single-process job on a thread,
the Ray job in parallel IO tasks (``mm_pipeline/cluster/caption_dataset.py``) before the bytes
travel to a captioning replica.  Reading never raises: a missing, unreadable or unsupported file
becomes a ``MediaInput`` with ``error`` set, which the job writes as an error row.  So does anything
but a regular file (a FIFO would block the reader for good, a device never ends) and a file over
the byte limit: both are refused from ``fstat``, before a byte is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import blake3

from mm_pipeline.errors import MMServeError
from mm_pipeline.media.ingest import read_regular_file
from mm_pipeline.media.sniff import sniff
from mm_pipeline.media.types import MediaKind


@dataclass(frozen=True)
class MediaInput:
    path: str
    data: bytes | None  # None when the file could not be read or is not media
    kind: MediaKind | None  # from the content (sniff), never from the name
    content_hash: str | None  # blake3 hex of the raw bytes: the same file under two names has one hash
    read_s: float  # reading, sniffing and hashing
    error: str | None = None  # the row's error text when reading or sniffing failed


def error_text(exc: BaseException) -> str:
    """An input's ``error`` field: the error's type and message (an ``MMServeError`` also its kind,
    and not the place in the job's own chat its message starts with: the line names the input)."""
    if isinstance(exc, MMServeError):
        return f"{type(exc).__name__} ({exc.kind}): {str(exc).removeprefix(f'{exc.loc}: ') if exc.loc else exc}"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def read_media_input(path: str, location: str | None = None, max_bytes: int | None = None) -> MediaInput:
    """Read, sniff and hash the input named ``path`` (blocking: run it on a thread or in an IO
    task).  ``location``: where to read it when that differs from its name (the Ray job names inputs
    as the user wrote them but reads them by absolute path, from any machine's working directory).
    ``max_bytes``: the engine's limit of one media item (None: no limit)."""
    t0 = time.perf_counter()
    data = digest = None
    try:
        data, _ = read_regular_file(location or path, max_bytes, path)
        digest = blake3.blake3(data).hexdigest()
        kind = sniff(data).primary
    except Exception as exc:  # one bad input must not stop the job
        # the hash of bytes that were read stays: it names what was refused
        return MediaInput(path, None, None, digest, time.perf_counter() - t0, error_text(exc))
    return MediaInput(path, data, kind, digest, time.perf_counter() - t0)

