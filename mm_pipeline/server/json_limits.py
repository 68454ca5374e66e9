"""The bounds a JSON text the server parses is held to before the parser builds anything: its bytes
(``max_request_bytes``), its values (``max_json_values``) and its objects (``max_json_objects``).
One owner for the rule and its wording: request bodies (request_body.py, counted as they arrive)
and the lines of a batch file (batches/lines.py, each line a request) both use it.

The parser builds every value before any field check runs, at ~100 bytes of memory a number (an
array of ints: ~20x the text), so the values are bounded on the raw text first (~1 ms a MB).
Objects are bounded apart: each becomes a model (a chat message, a content part) of several Python
objects, built with the GIL held and walked by the garbage collector's full collections, which stop
every thread. A chat of 300k messages (19 MB, inside the other limits) stalled the event loop for
~360 ms at a time and took 3 s to validate (benchmarks/body_validation.py); at 65,536 objects the
longest stall is ~30-60 ms, and any real chat fits (a message with a part and a tool call is 4).
"""

from __future__ import annotations

from dataclasses import dataclass


_COUNT_WINDOW = 1 << 20  # characters counted while the GIL is held (JSONLimits.line_problem, json_objects)


@dataclass(frozen=True)
class JSONLimits:
    """``ServerSettings.json_limits``: what one request's JSON may be."""

    max_bytes: int
    max_values: int
    max_objects: int = 65_536

    def line_problem(self, raw: bytes | str, what: str) -> tuple[str, str] | None:
        """(code, message) when the whole text ``raw`` (a batch line) holds too many values or
        objects to parse, or None. Every value takes at least a byte: a text no longer than the
        value cap needs no value count, only its braces. Counted in one pass a window at a time
        (no copy: ``count`` takes bounds) so a thread counting megabytes hands the GIL back between
        windows, ~0.5 ms each, instead of holding it ~100 ms for 60 MB."""
        if len(raw) <= self.max_values:
            braces = raw.count("{" if isinstance(raw, str) else b"{")  # type: ignore[arg-type]
        else:
            values = braces = 0
            for start in range(0, len(raw), _COUNT_WINDOW):
                more = json_counts(raw, start, start + _COUNT_WINDOW)
                values, braces = values + more[0], braces + more[1]
            if (problem := too_many_values(values, self.max_values, what)) is not None:
                return "too_many_json_values", problem
        if (problem := self.objects_problem(raw, what, braces)) is not None:
            return "too_many_json_objects", problem
        return None

    def objects_problem(self, raw: bytes | bytearray | str, what: str, braces: int | None = None) -> str | None:
        """Why ``raw`` holds too many objects to validate, or None. ``braces``: ``raw``'s opening
        braces when counted already (``json_counts``); only a text with more braces than the cap
        is counted exactly (braces inside strings are not objects)."""
        if braces is None:
            braces = raw.count("{" if isinstance(raw, str) else b"{")  # type: ignore[arg-type]
        if braces <= self.max_objects:
            return None
        text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
        if json_objects(text, self.max_objects + 1) <= self.max_objects:
            return None
        return f"{what} holds more than {self.max_objects} JSON objects (max_json_objects)"


def json_counts(raw: bytes | bytearray | str, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(an upper bound on the JSON values, the braces: one on the objects) of ``raw[start:end]``, in
    one pass per mark. Every array item and object member but the first follows a comma, the first a
    bracket (commas and braces inside strings only make the bounds looser). Adds up over the pieces
    of a text."""
    marks = (",", "[", "{") if isinstance(raw, str) else (b",", b"[", b"{")
    commas, arrays, objects = (raw.count(mark, start, end) for mark in marks)  # type: ignore[arg-type]
    return commas + arrays + objects, objects


def json_objects(raw: bytes, stop: int, window_bytes: int = _COUNT_WINDOW) -> int:
    """The objects in ``raw`` (each opening brace outside a string), counted up to ``stop``. A raw
    ``count(b"{")`` is an upper bound that braces inside strings inflate (a prompt holding source
    code), so a text over the cap by that bound is counted exactly, a window of 1 MB at a time: its
    escapes dropped (pairs of backslashes, then escaped quotes; a backslash run cut by the window's
    end is carried over by its parity), so every quote left opens or closes a string, and the
    braces counted between them. Every step is a C call over at most a window (a few ms with the
    GIL held, then other threads take turns), whatever the text holds: a Python step per escape
    made 16M escaped quotes take 5 s."""
    count, inside, escaped = 0, False, False
    for start in range(0, len(raw), window_bytes):
        window = raw[start:start + window_bytes]
        if escaped:  # the first character is the one a backslash of the last window escapes
            window = window[1:]
        run = len(window) - len(window.rstrip(b"\\"))
        escaped = run % 2 == 1
        if escaped:
            window = window[:-1]
        if b"\\" in window:
            window = window.replace(b"\\\\", b"").replace(b'\\"', b"")
        pieces = window.split(b'"')  # outside and inside strings in turn
        count += b"".join(pieces[1 if inside else 0::2]).count(b"{")
        inside ^= len(pieces) % 2 == 0
        if count >= stop:
            return stop
    return count


def too_many_values(values: int, max_values: int, what: str = "request body") -> str | None:
    """The message refusing ``values`` (``json_counts``' bound) over ``max_values``, or None."""
    if values <= max_values:
        return None
    return f"{what} holds up to {values} JSON values, over the limit of {max_values} (max_json_values)"


def too_many_bytes(max_bytes: int, what: str = "request body") -> str:
    """The message refusing a text longer than ``max_bytes``."""
    return f"{what} is over the {max_bytes}-byte limit (max_request_bytes)"
