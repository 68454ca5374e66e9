"""The HTTP/1.1 protocol uvicorn serves with: its httptools one, with the request head (request line
and headers) bounded.

Why: httptools bounds neither, so a client that sends one header of 150 MB -- before any key is
checked, the app sees nothing until the head is complete -- grew the server by that much per
connection (uvicorn's h11 protocol has a bound, h11_max_incomplete_event_size, but parses in
Python). Here the bytes a head takes are counted as they arrive; past ``max_head_bytes`` the
connection is answered 431 and closed (nginx answers a head past its buffers alike; vLLM added
h11 limits for the same attack). What the parser holds is thus at most the bound plus one read.
Without httptools, uvicorn's h11 protocol with the same bound serves instead, answering the same
431 (uvicorn's own answer to it is the plain 400 of a malformed request).

The 431 comes before the app, so before its ``X-Request-Id`` middleware (request_id.py): it names
a fresh id of its own in that header and in its log line, so the two can be matched. Not the
client's: its header may lie past the cut, and one read whole on one path would not be on the other.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mm_pipeline.server.request_id import REQUEST_ID_HEADER, new_request_id

MAX_HEAD_BYTES = 64 << 10  # request line + headers; browsers and SDKs send a few KB (cookies: up to ~16 KB)

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: h11 (below)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def protocol_kwargs(max_head_bytes: int = MAX_HEAD_BYTES, use_h11: bool = HttpToolsProtocol is None
                    ) -> dict[str, Any]:
    """``uvicorn.Config`` keywords for a bounded request head: uvicorn's httptools protocol where
    httptools is installed, else (or with ``use_h11``) its h11 one."""
    base = BoundedH11Protocol if use_h11 else BoundedHttpToolsProtocol
    return {"http": type(base.__name__, (base,), {"max_head_bytes": max_head_bytes})}


class HeadRefusal:
    """The 431 both protocols answer a head over ``max_head_bytes`` with (a uvicorn protocol's
    ``logger``, ``client`` and ``transport``), then the connection is closed."""

    max_head_bytes = MAX_HEAD_BYTES
    logger: Any
    client: tuple[str, int] | None
    transport: Any

    def _send_431(self) -> None:
        rid = new_request_id()
        body = json.dumps({"error": {"message": f"the request's headers are over {self.max_head_bytes} bytes",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "request_header_fields_too_large"}}).encode()
        self.logger.warning("%s: request head over %d bytes from %s: answered 431", rid, self.max_head_bytes,
                            "%s:%d" % self.client if self.client else "a client")
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n"
                             + REQUEST_ID_HEADER.lower().encode() + b": " + rid.encode() + b"\r\n"
                             b"connection: close\r\n\r\n" + body)
        self.transport.close()


class _BoundedConnection(h11.Connection):
    """h11's connection (its receive buffer bounded: ``max_incomplete_event_size``) that notes a
    request head over the bound (``head_too_big``) instead of raising: uvicorn answers whatever
    h11 raises with the 400 of a malformed request. Past a head (a chunked body's line too long)
    it raises as before."""

    head_too_big = False

    def next_event(self) -> Any:
        reading_head = self.their_state is h11.IDLE
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            if not (reading_head and exc.error_status_hint == 431):
                raise
            self.head_too_big = True
            return h11.NEED_DATA  # uvicorn stops reading events; handle_events answers


class BoundedH11Protocol(HeadRefusal, H11Protocol):
    """uvicorn's h11 protocol; a request head over ``max_head_bytes`` is a 431."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _BoundedConnection(h11.SERVER, self.max_head_bytes)  # in place of uvicorn's own, unused yet

    def handle_events(self) -> None:
        # as data comes, and as a response ends (a pipelined request's head, read then)
        super().handle_events()
        if self.conn.head_too_big and not self.transport.is_closing():
            self._send_431()


if HttpToolsProtocol is not None:
    class BoundedHttpToolsProtocol(HeadRefusal, HttpToolsProtocol):
        """uvicorn's httptools protocol; a request head over ``max_head_bytes`` is a 431."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = False  # between a message's first byte and the end of its headers
            self._head_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            # counted only when the whole read was head (the head began before it and is still
            # open after it): a read that also ends the previous message's body is not charged,
            # so a pipelined request never trips the bound early, and one read more is the slack
            was_in_head = self._in_head
            super().data_received(data)
            if not (was_in_head and self._in_head) or self.transport.is_closing():
                return
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._send_431()
