"""Stored responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

A response with ``store`` (OpenAI's default: true) is kept in memory with the conversation it ends
(its input as chat messages, its answer last) and its input items (for ``/input_items``), least
recently used dropped first once the entries pass ``responses_store_bytes``
(``--responses-store-bytes``, 256 MiB by default; 0 stores nothing).
The bound is what keeps a long-running server's memory flat: an unbounded store grows with every
request (the reason vLLM ships its store off by default). A follow-up whose previous response was
dropped is a 400 naming it; the client can resend the conversation as input instead.

An entry's size is the UTF-8 bytes of every string it holds plus a fixed overhead per value, the
response object included (instructions, tools and their schemas, text.format, the output and its
logprobs: a client controls all of them), counted without serialising it (inline media as base64
dominates). A conversation continued many times holds its earlier messages once in memory (the
entries share them) but each entry counts them again, so the bound errs on the safe side. One
process's memory: behind several ingress replicas (Ray Serve), a follow-up finds its previous
response only on the replica that answered it. A background response is held outside the store
while it runs and joins it when it ends, in any state (background.py says why).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mm_pipeline.server.responses_api.output import ResponseObject

_VALUE_OVERHEAD = 64  # bytes charged per value besides its characters (object headers, dict slots)
_ENTRY_OVERHEAD = 1024  # the entry, its place in the store and its id


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    history: list[dict[str, Any]]  # the chat messages a follow-up continues: the input, then the answer
    size: int
    input_items: list[dict[str, Any]]  # this request's input as GET .../input_items lists it


def held_bytes(value: Any, max_values: int | None = None) -> int | None:
    """The bytes charged for a JSON-like value, pydantic models in it too (module doc), walked
    without recursion; None when it holds more than ``max_values`` values (the walk stops there)."""
    total, values, stack = 0, 0, [value]
    limit = float("inf") if max_values is None else max_values
    while stack:
        v = stack.pop()
        values += 1
        if values > limit:
            return None
        if isinstance(v, str):
            # isascii() is O(1) in CPython; other text counts its UTF-8 bytes, up to 4 a character
            total += len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, BaseModel):
            stack.extend(v.__dict__.values())
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total + values * _VALUE_OVERHEAD


def entry_bytes(response: ResponseObject, history: list[dict[str, Any]], input_items: list[dict[str, Any]] = (),
                max_values: int | None = None) -> int | None:
    """The size charged for the entry of ``response``, ``history`` and ``input_items``: everything
    it holds (module doc); None when that is more than ``max_values`` values. Touches no store: a
    big entry is sized on a thread (routes.py)."""
    held = held_bytes((response, history, input_items), max_values)
    return None if held is None else held + _ENTRY_OVERHEAD


class ResponseStore:
    """In-memory, byte-bounded, least recently used first out. Used from the event loop only."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, size: int) -> bool:
        """Whether an entry of ``size`` (entry_bytes) can be held at all."""
        return size <= self.max_bytes

    def put(self, response: ResponseObject, history: list[dict[str, Any]], size: int,
            input_items: list[dict[str, Any]] = ()) -> None:
        """Keep ``response`` (``size``: entry_bytes, one that ``fits``), dropping the least recently
        used to make room."""
        self.delete(response.id)
        while self._entries and self.bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        self._entries[response.id] = StoredResponse(response, history, size, list(input_items))
        self.bytes += size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
