"""What may name a request (``X-Request-Id``, the body's ``request_id``): 1 to 128 printable ASCII
characters without spaces, so it can go into a header and a log line as it is.

Dependency-free on purpose: Ray Serve's proxies import ``cluster/serving/request_id_headers.py`` at
their start (the proxy callback), and a rule that lived beside the request models pulled torch and
the whole server in -- ~4 s of a proxy's start on an idle box, past Serve's readiness checks (three
of 5 s) on a busy one, which then killed the proxy and failed ``serve --ray``'s start."""

from __future__ import annotations

import re

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_PATTERN = r"^[!-~]+$"  # printable ASCII, no space (pydantic's regex: $ is the very end)
_CHARS = re.compile(r"[!-~]+")  # the same, matched whole (Python's $ would let a trailing newline by)


def valid_request_id(value: object) -> bool:
    """Whether ``value`` may name a request (a str of 1 to MAX_REQUEST_ID_CHARS printable ASCII
    characters, no space)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_CHARS and _CHARS.fullmatch(value) is not None
