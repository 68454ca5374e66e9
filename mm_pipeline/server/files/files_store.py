"""Uploaded files on disk: streamed in with a size cap, stored once per content hash.

    root/
      blobs/<blake3 hex>     the bytes, shared by every upload with the same content
      meta/<file id>.json    id, filename, purpose, size, created_at, content hash
      tmp/                   uploads in progress (renamed into blobs/ on commit)

The content hash is the same blake3 the media stages use on raw bytes, so asking many questions
about one upload hits the encoder cache after the first (the bytes, hence the media key, are equal).
Deleting a file removes its metadata, and its blob once no other file id points at it.

Quota: every file id counts its full size against ``max_total_bytes``, duplicates included (one
blob on disk, but a client must not create records without limit by re-uploading the same bytes),
and there are at most ``max_files`` ids.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import threading
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3

from mm_pipeline.errors import echo


class UploadTooLarge(Exception):
    """The upload passed the per-file cap or would overfill the store."""


class FileNotFoundInStore(KeyError):
    """No file with this id."""


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    content_hash: str


class UploadWriter:
    """One upload in progress: ``write`` chunks (blocking, call off the event loop for big ones),
    then ``commit`` or ``discard``.  Raises ``UploadTooLarge`` as soon as the cap is passed."""

    def __init__(self, store: "FilesStore", filename: str, purpose: str) -> None:
        self._store = store
        self.filename = filename
        self.purpose = purpose
        fd, tmp = tempfile.mkstemp(dir=store.root / "tmp")
        self._file = os.fdopen(fd, "wb")
        self._tmp = Path(tmp)
        self._hash = blake3.blake3()
        self.nbytes = 0

    def write(self, chunk: bytes) -> None:
        self.nbytes += len(chunk)
        if self.nbytes > self._store.max_file_bytes:
            self.discard()
            raise UploadTooLarge(f"file is larger than the {self._store.max_file_bytes}-byte upload limit")
        self._hash.update(chunk)
        self._file.write(chunk)

    def commit(self) -> FileRecord:
        self._file.close()
        if self.nbytes == 0:
            self._tmp.unlink(missing_ok=True)
            raise ValueError("uploaded file is empty")
        return self._store._commit(self._tmp, self._hash.hexdigest(), self)

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


class FilesStore:
    """File ids -> bytes on disk.  Thread-safe; survives restarts when ``root`` is kept."""

    def __init__(self, root: str | Path, max_file_bytes: int = 512 << 20, max_total_bytes: int = 8 << 30,
                 max_files: int = 10_000) -> None:
        if max_file_bytes <= 0 or max_total_bytes < max_file_bytes or max_files < 1:
            raise ValueError(f"FilesStore needs 0 < max_file_bytes <= max_total_bytes and max_files >= 1, got "
                             f"{max_file_bytes}, {max_total_bytes}, {max_files}")
        self.root = Path(root)
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.max_files = max_files
        for sub in ("blobs", "meta", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._records: dict[str, FileRecord] = {}
        for meta in (self.root / "meta").glob("file-*.json"):
            rec = FileRecord(**json.loads(meta.read_text()))
            if self._blob(rec.content_hash).is_file():
                self._records[rec.id] = rec
        for stale in (self.root / "tmp").iterdir():  # uploads cut off by a crash
            stale.unlink(missing_ok=True)

    # ---- public API -------------------------------------------------------------------------
    def begin_upload(self, filename: str, purpose: str) -> UploadWriter:
        return UploadWriter(self, _clean_name(filename), purpose)

    def put_bytes(self, data: bytes, filename: str, purpose: str = "user_data") -> FileRecord:
        """Store ``data`` in one call (tests, the batch runner)."""
        w = self.begin_upload(filename, purpose)
        w.write(data)
        return w.commit()

    def get(self, file_id: str) -> FileRecord:
        with self._lock:
            rec = self._records.get(file_id)
        if rec is None:
            raise FileNotFoundInStore(f"no file with id {echo(file_id)}")
        return rec

    def list(self, purpose: str | None = None) -> list[FileRecord]:
        with self._lock:
            recs = list(self._records.values())
        # oldest first; in one second (created_at's unit) as they were stored: the sort is stable
        return sorted((r for r in recs if purpose is None or r.purpose == purpose), key=lambda r: r.created_at)

    def path(self, file_id: str) -> Path:
        return self._blob(self.get(file_id).content_hash)

    def delete(self, file_id: str) -> FileRecord:
        with self._lock:
            rec = self._records.pop(file_id, None)
            if rec is None:
                raise FileNotFoundInStore(f"no file with id {echo(file_id)}")
            (self.root / "meta" / f"{file_id}.json").unlink(missing_ok=True)
            if not any(r.content_hash == rec.content_hash for r in self._records.values()):
                self._blob(rec.content_hash).unlink(missing_ok=True)
        return rec

    def resolve(self, file_id: str) -> tuple[Path, str | None]:
        """The engine's file resolver: (path of the bytes, original filename)."""
        rec = self.get(file_id)
        return self._blob(rec.content_hash), rec.filename

    @property
    def total_bytes(self) -> int:
        """Bytes counted against the quota: every file id's size, duplicates included."""
        with self._lock:
            return self._quota_bytes()

    def check_integrity(self) -> None:
        """Every record has its blob; every blob has a record; nothing is left in tmp/."""
        with self._lock:
            hashes = {r.content_hash for r in self._records.values()}
            blobs = {p.name for p in (self.root / "blobs").iterdir()}
            metas = {p.stem for p in (self.root / "meta").glob("file-*.json")}
            if hashes != blobs:
                raise AssertionError(f"blobs {sorted(blobs)} != record hashes {sorted(hashes)}")
            if metas != set(self._records):
                raise AssertionError(f"meta files {sorted(metas)} != records {sorted(self._records)}")
            for rec in self._records.values():
                if self._blob(rec.content_hash).stat().st_size != rec.bytes:
                    raise AssertionError(f"{rec.id}: blob size differs from the record")
        leftovers = list((self.root / "tmp").iterdir())
        if leftovers:
            raise AssertionError(f"unfinished uploads left in tmp/: {leftovers}")

    # ---- internal helpers -------------------------------------------------------------------
    def _blob(self, content_hash: str) -> Path:
        return self.root / "blobs" / content_hash

    def _quota_bytes(self) -> int:
        return sum(r.bytes for r in self._records.values())

    def _commit(self, tmp: Path, content_hash: str, w: UploadWriter) -> FileRecord:
        rec = FileRecord(id=f"file-{secrets.token_hex(12)}", filename=w.filename, purpose=w.purpose,
                         bytes=w.nbytes, created_at=int(time.time()), content_hash=content_hash)
        with self._lock:
            if self._quota_bytes() + w.nbytes > self.max_total_bytes:
                tmp.unlink(missing_ok=True)
                raise UploadTooLarge(f"the file store is full ({self.max_total_bytes} bytes)")
            if len(self._records) >= self.max_files:
                tmp.unlink(missing_ok=True)
                raise UploadTooLarge(f"the file store is full ({self.max_files} files)")
            blob = self._blob(content_hash)
            if blob.exists():  # same content uploaded before: keep one copy
                tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, blob)
            meta = self.root / "meta" / f"{rec.id}.json"
            meta.write_text(json.dumps(asdict(rec)))
            self._records[rec.id] = rec
        return rec


_UNPRINTED = ("Cc", "Cf", "Zl", "Zp")  # controls, format characters (bidi overrides), line / paragraph separators
_JOINERS = "\u200c\u200d"  # format characters that words and emoji are spelled with: kept


def _clean_name(name: str) -> str:
    """Keep the base name only (clients send paths), bounded in length, without control or format
    characters (a bidi override, \\x01): it is echoed in every file object and listed by the page."""
    printable = "".join(ch for ch in name or "" if ch in _JOINERS or unicodedata.category(ch) not in _UNPRINTED)
    base = re.split(r"[\\/]", printable)[-1].strip() or "upload"
    return base[:255]
