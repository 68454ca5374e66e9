"""The HTTP/1.1 protocol uvicorn serves with: its httptools one, with the request head (request line
and headers) bounded.

Why: httptools bounds neither, so a client that sends one header of 150 MB -- before any key is
checked, the app sees nothing until the head is complete -- grew the server by that much per
connection (uvicorn's h11 protocol has a bound, h11_max_incomplete_event_size, but parses in
Python). Here the bytes a head takes are counted as they arrive; past ``max_head_bytes`` the
connection is answered 431 and closed (nginx answers a head past its buffers alike; vLLM added
h11 limits for the same attack). What the parser holds is thus at most the bound plus one read.
Without httptools, uvicorn's h11 protocol with the same bound serves instead (``protocol_kwargs``).
"""

from __future__ import annotations

import json
from typing import Any

MAX_HEAD_BYTES = 64 << 10  # request line + headers; browsers and SDKs send a few KB (cookies: up to ~16 KB)

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: h11 (below)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def protocol_kwargs(max_head_bytes: int = MAX_HEAD_BYTES) -> dict[str, Any]:
    """``uvicorn.Config`` keywords for a bounded request head."""
    if HttpToolsProtocol is None:
        return {"http": "h11", "h11_max_incomplete_event_size": max_head_bytes}
    return {"http": type("BoundedHttpTools", (BoundedHttpToolsProtocol,), {"max_head_bytes": max_head_bytes})}


if HttpToolsProtocol is not None:
    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol; a request head over ``max_head_bytes`` is a 431."""

        max_head_bytes = MAX_HEAD_BYTES

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

        def _send_431(self) -> None:
            body = json.dumps({"error": {"message": f"the request's headers are over {self.max_head_bytes} bytes",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "request_header_fields_too_large"}}).encode()
            self.logger.warning("request head over %d bytes from %s: answered 431", self.max_head_bytes,
                                "%s:%d" % self.client if self.client else "a client")
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()
