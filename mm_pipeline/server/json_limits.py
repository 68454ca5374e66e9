"""The bounds a JSON text the server parses is held to before the parser builds anything: its bytes
(``max_request_bytes``) and its values (``max_json_values``). One owner for the rule and its wording:
request bodies (app.parse_body, counted as they arrive) and the lines of a batch file
(batches/lines.py, each line a request) both use it.

The parser builds every value before any field check runs, at ~100 bytes of memory a number (an
array of ints: ~20x the text), so the values are bounded on the raw text first (~1 ms a MB).
"""

from __future__ import annotations

from dataclasses import dataclass

_COUNT_WINDOW = 1 << 20  # characters counted while the GIL is held (JSONLimits.values_problem)


@dataclass(frozen=True)
class JSONLimits:
    """``ServerSettings.json_limits``: what one request's JSON may be."""

    max_bytes: int
    max_values: int

    def values_problem(self, raw: bytes | str, what: str) -> str | None:
        """Why the whole text ``raw`` holds too many values to parse, or None. Every value takes at
        least a byte: a text no longer than the cap needs no count. Counted a window at a time (no
        copy: ``count`` takes bounds) so a thread counting megabytes hands the GIL back between
        windows, ~0.5 ms each, instead of holding it ~100 ms for 60 MB."""
        if len(raw) <= self.max_values:
            return None
        values = sum(json_values_bound(raw, start, start + _COUNT_WINDOW)
                     for start in range(0, len(raw), _COUNT_WINDOW))
        return too_many_values(values, self.max_values, what)


def json_values_bound(raw: bytes | bytearray | str, start: int = 0, end: int | None = None) -> int:
    """An upper bound on the JSON values in ``raw[start:end]``: every array item and object member
    but the first follows a comma, the first a bracket (commas inside strings only make it
    looser). Adds up over the pieces of a text."""
    marks = (",", "[", "{") if isinstance(raw, str) else (b",", b"[", b"{")
    return sum(raw.count(mark, start, end) for mark in marks)  # type: ignore[arg-type]


def too_many_values(values: int, max_values: int, what: str = "request body") -> str | None:
    """The message refusing ``values`` (a ``json_values_bound``) over ``max_values``, or None."""
    if values <= max_values:
        return None
    return f"{what} holds up to {values} JSON values, over the limit of {max_values} (max_json_values)"


def too_many_bytes(max_bytes: int, what: str = "request body") -> str:
    """The message refusing a text longer than ``max_bytes``."""
    return f"{what} is over the {max_bytes}-byte limit (max_request_bytes)"
