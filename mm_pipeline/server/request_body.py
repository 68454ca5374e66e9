"""A JSON request body read under the server's limits (json_limits.py) and validated into a request
model (``parse_body``, used by every route that takes one).

Read: the declared length and the bytes so far against ``max_request_bytes``, and once the body is
longer than ``max_json_values`` bytes its values and braces counted as they arrive (each value takes
a byte, so a shorter body cannot hold too many), all before pydantic builds anything; then its
objects against ``max_json_objects``.

A body that stops arriving (no bytes for ``request_body_idle_s``, ``BODY_IDLE_S`` by default) is
answered 408 and its connection closed (``body_chunks``, uploads too): uvicorn has no body timeout,
so a client that declared a length and went quiet held its connection and handler for good.

Validated on the event loop only when that is short (at most 256 KiB and 512 braces: a few ms);
otherwise on a worker thread, where pydantic still holds the GIL while it parses and builds, but
hands it over at every Python validator (a chat message has one), so the loop interleaves. A body
of megabytes of base64 media is parsed with the GIL held throughout (~1 ms a MB, which the loop
waits out), the reason big media is better sent as an upload (/v1/files) or a URL.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from mm_pipeline.server.errors import APIError
from mm_pipeline.server.json_limits import JSONLimits, json_counts, too_many_bytes, too_many_values

_INLINE_PARSE_BYTES = 256 * 1024  # larger bodies (base64 media) are parsed on a thread
_INLINE_OBJECTS = 512  # and bodies of more objects (models at 3-18 us each, a few ms on the loop at most)
BODY_IDLE_S = 60.0  # the default longest wait for the next piece of a body (ServerSettings.request_body_idle_s)
async def body_chunks(request: Request, idle_s: float) -> AsyncIterator[bytes]:
    """``request.stream()``, with at most ``idle_s`` between two pieces: past it, 408."""
    pieces = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), idle_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stalled: no bytes arrived for {idle_s:g} s") from None
        yield chunk


async def parse_body(request: Request, model: type[BaseModel], limits: JSONLimits,
                     idle_s: float = BODY_IDLE_S) -> Any:
    """Read and validate a JSON body: 413 over a limit, 422 (RequestValidationError) when invalid,
    408 when no bytes arrive for ``idle_s`` (``ServerSettings.request_body_idle_s``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise APIError(413, f"request body of {declared} bytes is over the {limits.max_bytes}-byte limit")
    raw = bytearray()
    counts = None  # (values, braces), counted once the body is longer than max_values bytes
    async for chunk in body_chunks(request, idle_s):
        raw += chunk
        if len(raw) > limits.max_bytes:
            raise APIError(413, too_many_bytes(limits.max_bytes))
        # counted as it arrives, a piece at a time: over the whole body at the end, the three
        # passes held the GIL for ~80 ms at 100 MB in one go; and a body over the cap stops here
        if len(raw) > limits.max_values:
            more = json_counts(raw if counts is None else chunk)
            counts = more if counts is None else (counts[0] + more[0], counts[1] + more[1])
            _check_values(counts[0], limits.max_values)
    braces = None
    try:
        if len(raw) <= _INLINE_PARSE_BYTES:
            data = bytes(raw)
            braces = data.count(b"{")  # ~0.6 ms a MB
            if braces <= _INLINE_OBJECTS:
                return _validate(model, data, limits, counts, braces)
        # the buffer itself goes to the thread: bytes(raw) is a copy, ~65 ms on the loop for 160 MB
        return await asyncio.to_thread(_validate_off_loop, model, raw, limits, counts, braces)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _check_values(values: int, max_values: int) -> None:
    if (problem := too_many_values(values, max_values)) is not None:
        raise APIError(413, problem)


def _validate(model: type[BaseModel], raw: bytes, limits: JSONLimits, counts: tuple[int, int] | None = None,
              braces: int | None = None) -> Any:
    """``counts``: ``json_counts(raw)`` when the caller counted it already; ``braces``: the
    braces alone, when only those were counted."""
    # The parser builds every value before any field check runs, at ~100 bytes of memory a number
    # (an array of ints: ~20x the body), so the bounds are checked first, ~1 ms a MB, before anything
    # is built. Every value takes at least a byte: a body no longer than the cap needs no count.
    if counts is None and len(raw) > limits.max_values:
        counts = json_counts(raw)
    if counts is not None:
        _check_values(counts[0], limits.max_values)
        braces = counts[1]
    if (problem := limits.objects_problem(raw, "request body", braces)) is not None:
        raise APIError(413, problem)
    return model.model_validate_json(raw)


def _validate_off_loop(model: type[BaseModel], raw: bytearray, limits: JSONLimits,
                       counts: tuple[int, int] | None, braces: int | None = None) -> Any:
    """``_validate`` on a worker thread, of a copy of the receive buffer: pydantic parses a
    bytearray ~2x slower than bytes (104 vs 53 ms at 100 MB, the GIL held throughout). The copy
    holds the GIL too; the sleep between the two hands it to a thread waiting for it (the event
    loop), which then waits out the longer of the two holds, not their sum."""
    data = bytes(raw)
    time.sleep(0)
    return _validate(model, data, limits, counts, braces)
