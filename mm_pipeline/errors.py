"""The errors the pipeline reports to its callers: one hierarchy, each class with the kind it is.

A caller (the HTTP server, the batch and caption jobs, the offline API) decides what to do by the
*type* of the error, never by its message. The kind is the type's short wire name: the text
engine's kinds (``llm_core.engine.outputs.ErrorKind``) plus the two this layer adds, "media" and
"overloaded". The HTTP status of each type lives in one table in ``mm_pipeline/server/errors.py``.

    MMServeError
    ├── InvalidInputError           invalid_input   the request is malformed
    │   ├── InvalidMessageError                     a chat message or content part
    │   └── ContextLengthError      context_length  too long for the model or the KV pools
    ├── MediaError                  media           a media item is unusable
    │   ├── InvalidMediaError                       malformed reference (bad data URL, empty payload)
    │   ├── UndecodableMediaError                   the type is known, the content does not decode
    │   ├── MediaFetchError                         a remote fetch failed (refused, HTTP error status)
    │   │   └── MediaFetchTimeout                   the remote host was too slow
    │   ├── MediaAccessDenied                       local path outside the allowed dirs; host not allowed
    │   ├── MediaNotFound                           allowed local path or file id that does not exist
    │   ├── MediaTooLarge                           bytes / pixels / duration / frames over a limit
    │   └── UnsupportedMediaType                    sniffed as no supported type, or not the declared kind
    ├── OverloadedError             overloaded      too many requests in flight: retry after ``retry_after``
    │   └── ServerBusy                              a shared resource stayed saturated (the decode pool),
    │                                               or the engine shut down under the request
    └── InternalError               internal        a bug or a device failure (a model step raised)

An engine output that ended in error carries its kind; :func:`generation_error` turns it back into
the type above, so engine failures and raised errors reach callers the same way.
"""

from __future__ import annotations

from typing import ClassVar

from llm_core.engine.outputs import ErrorKind


class Where(tuple):
    """Where in a request a problem is, as steps: ``Where(("messages", 1, "content", 0))``. Formatted
    it is the request's own spelling, ``messages[1].content[0]``, which every message of an
    ``InvalidMessageError`` naming it starts with."""

    def then(self, *steps: str | int) -> "Where":
        return Where((*self, *steps))

    def __str__(self) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if k else p for k, p in enumerate(self))


ECHO_CHARS = 100  # of a value a client sent, quoted back in an error message


def echo(value: object) -> str:
    """``repr(value)`` of something a client sent, cut to ECHO_CHARS: a message quotes it (an id of
    100,000 characters must not come back whole, and a batch keeps its lines' messages)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS - 1] + "…"


class MMServeError(Exception):
    """Base class: a failure a caller must hear about, classified by its type. ``loc`` (a ``Where``;
    empty when the error names no place) is the part of the request the message is about, which
    the message then starts with: a 400's ``param``, and what the Responses API renames to its
    input items (a message or content part the parser refused, a media item that failed)."""

    kind: ClassVar[str] = ErrorKind.INTERNAL.value
    loc: Where = Where()  # (the class's too: an error rebuilt without __init__, as a copy may be, has one)

    def __init__(self, *args: object, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(*args)
        self.loc = Where(loc)

    def located(self, message: str, loc: tuple[str | int, ...]) -> "MMServeError":
        """This error again, as ``message`` about ``loc``: of its own class, or of the nearest base
        class built from a message alone where its own constructor takes other arguments."""
        cls = next(c for c in type(self).__mro__ if c.__init__ is MMServeError.__init__)
        return cls(message, loc=loc)


class InvalidInputError(MMServeError):
    kind = ErrorKind.INVALID_INPUT.value


class InvalidMessageError(InvalidInputError):
    """A chat message, content part or template option the server cannot take (its ``loc``: where
    the message says the problem is)."""


class ContextLengthError(InvalidInputError):
    kind = ErrorKind.CONTEXT_LENGTH.value


class MediaError(MMServeError):
    kind = "media"


class InvalidMediaError(MediaError):
    pass


class UndecodableMediaError(MediaError):
    pass


class MediaFetchError(MediaError):
    pass


class MediaFetchTimeout(MediaFetchError):
    pass


class MediaAccessDenied(MediaError):
    pass


class MediaNotFound(MediaError):
    pass


class MediaTooLarge(MediaError):
    pass


class UnsupportedMediaType(MediaError):
    pass


class OverloadedError(MMServeError):
    kind = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)  # about the server, never a place in the request
        self.retry_after = retry_after  # seconds a client should wait before trying again


class ServerBusy(OverloadedError):
    pass


class InternalError(MMServeError):
    kind = ErrorKind.INTERNAL.value


# The class an engine kind comes back as (every ErrorKind has one; tests check it).
_OF_ENGINE_KIND: dict[str, type[MMServeError]] = {
    cls.kind: cls for cls in (InvalidInputError, ContextLengthError, InternalError)
}


def generation_error(finish_reason: str | None, kind: str | None, message: str | None) -> MMServeError | None:
    """The error a finished generation reports, typed by its kind (None when it did not fail).

    "error" becomes the class of ``kind`` (an unknown or missing kind is internal: the engine did
    not say the caller was at fault); "abort" without the caller asking means the engine shut
    down under the request, which a client should retry (``ServerBusy``)."""
    if finish_reason == "error":
        return _OF_ENGINE_KIND.get(kind or "", InternalError)(message or "generation failed")
    if finish_reason == "abort":
        return ServerBusy(message or "request aborted by the server (shutting down?)")
    return None
