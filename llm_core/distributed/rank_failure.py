"""The error a parallel engine raises when a rank is gone or a collective fails: it is never one
request's fault, so the engine does not isolate it per request; it ends the engine (and a server)."""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A rank of the tensor- / expert-parallel group died or stopped answering."""
