"""``POST /v1/files``: a multipart body parsed as it arrives, the file part written straight into
the ``FilesStore`` (never held whole in memory, never spooled twice), the size cap enforced while
streaming so an oversized upload is cut off at the cap, not after it has been received.

``receive_form`` parses the same way for a request that only needs its file while it runs (the
audio API: server/audio/): the file part is kept in memory under its own, smaller cap, with the
form's plain fields.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from mm_pipeline.server.errors import APIError
from mm_pipeline.server.files.files_store import FileRecord, FilesStore, UploadTooLarge, UploadWriter
from mm_pipeline.server.request_body import BODY_IDLE_S, body_chunks

_FIELD_LIMIT = 4096  # bytes of a plain form field (purpose)
_MAX_FIELDS = 16  # plain form fields per upload (only 'purpose' is read): each is held in memory
_MAX_BOUNDARY = 70
_BODY_SLACK = 64 * 1024  # multipart headers, boundaries and fields on top of the file's own bytes
_FLUSH_BYTES = 1 << 20  # disk writes go to a thread in chunks of about this size
_PURPOSES = {"user_data", "vision", "assistants", "batch", "fine-tune", "evals"}
# python-multipart logs a WARNING for every malformed body ("Expected boundary character ..."):
# any client could fill the log with them; the client's 400 says what was wrong
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)


@dataclass(frozen=True)
class FormUpload:
    """A multipart form read into memory (``receive_form``): its one file and its plain fields."""

    data: bytes
    filename: str
    fields: dict[str, str]


class _Parts:
    """python-multipart callbacks -> (fields, one file part fed into an UploadWriter, or kept in
    memory when there is no store)."""

    def __init__(self, store: FilesStore | None, max_file_bytes: int) -> None:
        self.store = store
        self.max_file_bytes = max_file_bytes
        self.filename: str | None = None  # of the file part, once its headers are read
        self.fields: dict[str, str] = {}
        self.writer: UploadWriter | None = None
        self.pending: list[bytes] = []  # file bytes parsed but not yet written
        self.pending_bytes = 0
        self._hname = b""
        self._hvalue = b""
        self._disposition = b""
        self._name = ""
        self._is_file = False
        self._buf = bytearray()
        self.ended = False  # the closing boundary arrived: a body cut short never sets it

    def callbacks(self) -> dict:
        return {"on_part_begin": self._part_begin, "on_part_data": self._part_data, "on_part_end": self._part_end,
                "on_header_field": self._header_field, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
                "on_end": self._end}

    def _end(self) -> None:
        self.ended = True

    def _part_begin(self) -> None:
        self._disposition, self._name, self._is_file, self._buf = b"", "", False, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        if self._hname.lower() == b"content-disposition":
            self._disposition = self._hvalue
        self._hname, self._hvalue = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise APIError(400, "multipart part without a name in Content-Disposition")
        self._name = options[b"name"].decode("utf-8", "replace")
        # the part named 'file' is the file even with an empty or no filename (what httpx sends for
        # ("", data)): read as a plain field it was refused as "too long"
        if b"filename" in options or self._name == "file":
            if self._name != "file":
                raise APIError(400, f"unexpected file field {self._name!r} (use 'file')", param=self._name)
            if self.filename is not None:
                raise APIError(400, "only one file per upload", param="file")
            self._is_file = True
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
            if self.store is not None:
                self.writer = self.store.begin_upload(self.filename, "user_data")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = bytes(data[start:end])
        if self._is_file:
            self.pending.append(chunk)
            self.pending_bytes += len(chunk)
            if (self.writer.nbytes if self.writer is not None else 0) + self.pending_bytes > self.max_file_bytes:
                raise UploadTooLarge(f"file is larger than the {self.max_file_bytes}-byte upload limit")
        else:
            self._buf += chunk
            if len(self._buf) > _FIELD_LIMIT:
                raise APIError(400, f"form field {self._name!r} is too long", param=self._name)

    def _part_end(self) -> None:
        if not self._is_file:
            if self._name not in self.fields and len(self.fields) >= _MAX_FIELDS:
                raise APIError(400, f"upload has more than {_MAX_FIELDS} form fields")
            self.fields[self._name] = self._buf.decode("utf-8", "replace")

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending, self.pending_bytes = [], 0
        return data


async def _parse(request: Request, parts: _Parts, what: str, idle_s: float) -> None:
    """Feed the request's multipart body to ``parts`` as it arrives, the body capped at the file's
    cap plus room for headers and fields (a chunked body declares no length: counted as it comes).
    With a store the file's bytes go to disk in chunks as they come; else they stay in ``pending``."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise APIError(415, f"{what} must be multipart/form-data with a 'file' part")
    boundary = params[b"boundary"]
    if not 1 <= len(boundary) <= _MAX_BOUNDARY:  # RFC 2046: 1 to 70 characters
        raise APIError(400, f"multipart boundary must be 1 to {_MAX_BOUNDARY} characters, got {len(boundary)}")
    body_cap = parts.max_file_bytes + _BODY_SLACK
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_cap:
        raise UploadTooLarge(f"{what} of {declared} bytes is over the {parts.max_file_bytes}-byte limit")
    received = 0
    parser = MultipartParser(boundary, parts.callbacks())
    async for chunk in body_chunks(request, idle_s):  # 408 when it stalls
        received += len(chunk)
        if received > body_cap:
            raise UploadTooLarge(f"{what} is over the {parts.max_file_bytes}-byte limit")
        parser.write(chunk)
        if parts.writer is not None and parts.pending_bytes >= _FLUSH_BYTES:
            await asyncio.to_thread(parts.writer.write, parts.take_pending())
    parser.finalize()
    if not parts.ended:  # python-multipart's finalize does not check the closing boundary
        raise APIError(400, f"{what} is truncated: the multipart body ends before its closing boundary")
    if parts.filename is None:
        raise APIError(400, f"{what} has no 'file' part", param="file")


def _unparsable(what: str, exc: FormParserError) -> APIError:
    """A body python-multipart cannot parse: its own words ("Expected boundary character 45, got
    103 at index 2") go to the log line, not to the client (README "Limits and security")."""
    return APIError(400, f"invalid {what}: the multipart/form-data body does not parse (a boundary, "
                         f"part header or line ending out of place)", detail=f"python-multipart: {exc}")


async def receive_upload(request: Request, store: FilesStore, idle_s: float = BODY_IDLE_S) -> FileRecord:
    """Parse the upload request and commit its file; raises ``APIError`` (400 / 408 / 413 / 415);
    ``idle_s``: the longest wait for the next piece of the body."""
    parts = _Parts(store, store.max_file_bytes)
    try:
        await _parse(request, parts, "upload", idle_s)
        if parts.pending:
            await asyncio.to_thread(parts.writer.write, parts.take_pending())
        purpose = parts.fields.get("purpose", "user_data") or "user_data"
        if purpose not in _PURPOSES:
            raise APIError(400, f"unknown purpose {purpose!r}; expected one of {sorted(_PURPOSES)}", param="purpose")
        parts.writer.purpose = purpose
        return await asyncio.to_thread(parts.writer.commit)
    except UploadTooLarge as exc:
        raise APIError(413, str(exc), param="file") from None
    except FormParserError as exc:
        raise _unparsable("upload", exc) from None
    except ValueError as exc:  # ours: an empty file, a field over its limits
        raise APIError(400, f"invalid upload: {exc}") from None
    finally:
        if parts.writer is not None:
            parts.writer.discard()  # no-op after a commit (the temp file was moved)


async def receive_form(request: Request, max_file_bytes: int, what: str = "request", idle_s: float = BODY_IDLE_S
                       ) -> FormUpload:
    """Parse a multipart form whose one file part (named 'file') is kept in memory, at most
    ``max_file_bytes`` of it (413 past it, cut off as it streams); raises ``APIError`` (400 / 413
    / 415). An empty file is a 400."""
    parts = _Parts(None, max_file_bytes)
    try:
        await _parse(request, parts, what, idle_s)
    except UploadTooLarge as exc:
        raise APIError(413, str(exc), param="file") from None
    except FormParserError as exc:
        raise _unparsable(what, exc) from None
    except ValueError as exc:  # ours: a field over its limits
        raise APIError(400, f"invalid {what}: {exc}") from None
    data = parts.take_pending()
    if not data:
        raise APIError(400, f"the {what}'s file is empty", param="file")
    return FormUpload(data, parts.filename or "", dict(parts.fields))
