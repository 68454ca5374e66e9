"""Errors raised by the media stages, each carrying the HTTP status the server answers with.

The server maps any ``MediaError`` to ``status`` and ``str(error)`` without knowing the subclass;
everything else that escapes a media stage is a bug (HTTP 500).

    MediaError (400)
    ├── InvalidMediaError        400  malformed reference (bad data URL, empty payload, bad scheme)
    ├── UndecodableMediaError    400  the type is known but the content does not decode
    ├── MediaFetchError          400  a remote fetch failed (connection refused, HTTP error status)
    │   └── MediaFetchTimeout    408  the remote host was too slow
    ├── MediaAccessDenied        403  local path outside the allowed dirs; host not on the allow-list
    ├── MediaNotFound            404  allowed local path that does not exist
    ├── MediaTooLarge            413  bytes / pixels / duration / frames over a configured limit
    ├── UnsupportedMediaType     415  content sniffed as no supported type, or not the declared kind
    └── ServerBusy               503  the decode pool's queue stayed full past the wait limit
"""

from __future__ import annotations


class MediaError(Exception):
    """Base class: a problem with one media item that the client caused or must hear about."""

    status: int = 400


class InvalidMediaError(MediaError):
    status = 400


class UndecodableMediaError(MediaError):
    status = 400


class MediaFetchError(MediaError):
    status = 400


class MediaFetchTimeout(MediaFetchError):
    status = 408


class MediaAccessDenied(MediaError):
    status = 403


class MediaNotFound(MediaError):
    status = 404


class MediaTooLarge(MediaError):
    status = 413


class UnsupportedMediaType(MediaError):
    status = 415


class ServerBusy(MediaError):
    status = 503
