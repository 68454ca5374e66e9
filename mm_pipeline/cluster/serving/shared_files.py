"""Uploaded files a replica serves while a request runs: the ingress keeps uploads (its
``--files-dir``) and sends the bytes of the files a request names with it; the replica holds them,
counted per request, for its media planner's file resolver, and drops them when the last request
naming them ends. Used by LLM and encoder replicas alike."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedFile:
    data: bytes
    filename: str | None


class ReplicaFiles:
    def __init__(self) -> None:
        self._files: dict[str, tuple[SharedFile, int]] = {}  # file id -> (bytes, requests using it)
        self._lock = threading.Lock()  # the planner resolves on its worker threads

    def resolve(self, file_id: str) -> tuple[bytes, str | None]:
        """The planner's file resolver; an id no running request sent raises ``KeyError``."""
        with self._lock:
            held = self._files.get(file_id)
        if held is None:
            raise KeyError(file_id)
        return held[0].data, held[0].filename

    def hold(self, files: dict[str, SharedFile] | None) -> None:
        with self._lock:
            for fid, f in (files or {}).items():
                _, n = self._files.get(fid, (f, 0))
                self._files[fid] = (f, n + 1)

    def release(self, files: dict[str, SharedFile] | None) -> None:
        with self._lock:
            for fid in files or {}:
                f, n = self._files.get(fid, (None, 1))
                if n <= 1:
                    self._files.pop(fid, None)
                else:
                    self._files[fid] = (f, n - 1)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)
