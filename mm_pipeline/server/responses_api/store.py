"""Stored responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

A response with ``store`` (OpenAI's default: true) is kept in memory with the conversation it ends
(its input as chat messages, its answer last) and its input items (for ``/input_items``), least recently used dropped first once the entries
pass ``responses_store_bytes`` (``--responses-store-bytes``, 256 MiB by default; 0 stores nothing).
The bound is what keeps a long-running server's memory flat: an unbounded store grows with every
request (the reason vLLM ships its store off by default). A follow-up whose previous response was
dropped is a 400 naming it; the client can resend the conversation as input instead.

Sizes are the characters of the strings the entry holds (inline media as base64 dominates) plus a
fixed overhead per value, counted without serialising it. A conversation continued many times holds
its earlier messages once in memory (the entries share them) but each entry counts them again, so
the bound errs on the safe side. One process's memory: behind several ingress replicas (Ray
Serve), a follow-up finds its previous response only on the replica that answered it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mm_pipeline.server.responses_api.output import ResponseObject

_VALUE_OVERHEAD = 64  # bytes charged per value besides its characters (object headers, dict slots)
_ENTRY_OVERHEAD = 4096  # the response object itself, its items and ids


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    history: list[dict[str, Any]]  # the chat messages a follow-up continues: the input, then the answer
    size: int
    input_items: list[dict[str, Any]]  # this request's input as GET .../input_items lists it


def held_bytes(value: Any) -> int:
    """The bytes charged for a JSON-like value (module doc), walked without recursion."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        total += _VALUE_OVERHEAD
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


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

    def fits(self, history: list[dict[str, Any]], input_items: list[dict[str, Any]] = ()) -> int | None:
        """The size an entry of ``history`` and ``input_items`` would have, or None when it can never fit."""
        size = held_bytes(history) + held_bytes(list(input_items)) + _ENTRY_OVERHEAD
        return size if size <= self.max_bytes else None

    def put(self, response: ResponseObject, history: list[dict[str, Any]], size: int,
            input_items: list[dict[str, Any]] = ()) -> None:
        """Keep ``response`` (``size`` from ``fits``), dropping the least recently used to make room."""
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
