"""Entries in Redis: an optional shared tier across servers.

Redis being down, slow or restarted is normal operation for a cache: every failure is a miss (or
a dropped put), bounded by a short socket timeout, and after a failure to reach Redis the store stops
talking to it for ``retry_after_s`` so a dead server costs one timeout per interval, not one per
request. An error Redis answers with (OOM at ``maxmemory`` under ``noeviction``, WRONGTYPE, READONLY)
fails only that command: the server is up, and a full Redis still serves reads.
Values use the checksummed envelope, so a foreign or damaged value under our key is a miss.

Every Redis URL in the project (the encoder cache's ``redis_url``, the KV cache's ``kv_store``) is
parsed here, by :meth:`RedisAddress.from_url`.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from llm_core.storage.entry_codec import CorruptEntry, decode_entry, encode_entry
from llm_core.storage.kv_store import KeyValueStore

T = TypeVar("T")

URL_FORM = "redis://[[user]:password@]host[:port][/db]"

# Failures that say Redis cannot be reached or cannot serve at all (not one command's error): refused or
# reset connections, timeouts, a peer that does not speak Redis, a server still loading or whose master is
# down. Everything else a RedisError reports (ResponseError: OOM, WRONGTYPE, READONLY, ...) came from a
# server that answers, so backing off would only turn its working reads into misses.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.InvalidResponse,
                redis.exceptions.ClusterDownError, OSError)


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis server is and how to log in: what a Redis URL says."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_url(cls, url: str) -> "RedisAddress":
        """Parse ``redis://[[user]:password@]host[:port][/db]`` (host, port and db default to
        127.0.0.1, 6379 and 0). Raises ValueError naming what is wrong; the message never shows
        the password."""
        if not isinstance(url, str):
            raise ValueError(f"a Redis URL must be a str of the form {URL_FORM}, got {type(url).__name__}")
        text = url.strip()
        parts = urllib.parse.urlsplit(text)
        shown = _without_password(text, parts)
        if not text.lower().startswith("redis://"):
            raise ValueError(f"Redis URL {shown!r} must start with redis:// (form: {URL_FORM})")
        if parts.query or parts.fragment:
            raise ValueError(f"Redis URL {shown!r}: query parameters and fragments are not supported")
        try:
            port = parts.port
        except ValueError as exc:  # "Port could not be cast ..." / "Port out of range ..."
            raise ValueError(f"Redis URL {shown!r}: bad port ({exc})") from None
        if port == 0:
            raise ValueError(f"Redis URL {shown!r}: port must be in 1..65535")
        db_text = parts.path[1:] if parts.path.startswith("/") else parts.path
        if db_text and not (db_text.isascii() and db_text.isdigit()):
            raise ValueError(f"Redis URL {shown!r}: the database after the host must be a number >= 0, "
                             f"got {db_text!r}")
        unquote = urllib.parse.unquote
        return cls(host=parts.hostname or cls.host, port=port or cls.port, db=int(db_text or 0),
                   username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None)


def _without_password(url: str, parts: urllib.parse.SplitResult) -> str:
    """``url`` with its password (if any) replaced by ``***``, for error messages."""
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class RedisStore(KeyValueStore):
    name = "redis"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0,
                 prefix: str = "mmserve:", timeout_s: float = 0.25, ttl_s: int | None = None,
                 retry_after_s: float = 5.0, client: redis.Redis | None = None, *,
                 username: str | None = None, password: str | None = None) -> None:
        super().__init__()
        if timeout_s <= 0 or retry_after_s < 0:
            raise ValueError(f"RedisStore needs timeout_s > 0 and retry_after_s >= 0, got "
                             f"{timeout_s}, {retry_after_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"RedisStore.ttl_s must be positive or None, got {ttl_s}")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self._client = client or redis.Redis(
            host=host, port=port, db=db, username=username, password=password,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the client's default retries with backoff take seconds
        )
        self._down_until = 0.0
        self._state_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "mmserve:", **options: Any) -> "RedisStore":
        """A store on the server a ``redis://`` URL names (see ``RedisAddress.from_url``; raises
        ValueError for a malformed URL). ``prefix`` namespaces the keys; ``options`` as for the
        constructor (timeout_s, ttl_s, retry_after_s)."""
        a = RedisAddress.from_url(url)
        return cls(host=a.host, port=a.port, db=a.db, prefix=prefix, username=a.username, password=a.password,
                   **options)

    # ---- public API -------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        self._check_key(key)
        raw = self._call(lambda c: c.get(self.prefix + key))
        if raw is None:
            self._count("misses")
            return None
        try:
            value = decode_entry(raw, key)
        except CorruptEntry:
            self._count("corrupt")
            value = self._call(lambda c: self._delete_unless_replaced(c, key, raw))
        self._count("hits" if value is not None else "misses")
        return value

    def put(self, key: str, value: bytes, *, keep_existing: bool = False) -> bool:
        self._check_key(key)
        self._check_value(value)
        raw = encode_entry(key, bytes(value))
        if keep_existing:
            return self._put_unless_present(key, raw)
        ok = self._call(lambda c: c.set(self.prefix + key, raw, ex=self.ttl_s))
        self._count("puts" if ok else "dropped")
        return bool(ok)

    def _put_unless_present(self, key: str, raw: bytes) -> bool:
        """``SET NX`` (atomic against every client of the server); a key already there gets its
        expiry refreshed in the same round trip, as a plain put would. A value already there is kept
        only when it reads back whole (``_replace_if_damaged``)."""
        name = self.prefix + key

        def op(c: redis.Redis):
            pipe = c.pipeline(transaction=False)
            pipe.set(name, raw, ex=self.ttl_s, nx=True)
            if self.ttl_s:
                pipe.expire(name, self.ttl_s)
            return pipe.execute()

        done = self._call(op)
        if done is not None and not done[0]:  # a value is there
            done = self._call(lambda c: self._replace_if_damaged(c, key, raw))
        if done is None:
            self._count("dropped")
            return False
        self._count("puts" if done[0] else "kept")
        return True

    def _replace_if_damaged(self, c: redis.Redis, key: str, raw: bytes) -> list[bool]:
        """``[True]`` after replacing the value under ``key`` by ``raw`` when it is damaged (or gone
        meanwhile), ``[False]`` when it is whole and kept. A chain read stops at its first missing
        page, so a damaged page further down is never read (hence never deleted) by a ``get``, and
        ``SET NX`` alone would keep it for good. Only puts that find a value pay this read; ``WATCH``
        makes the replace fail, keeping the newer value, if another client wrote the key since."""
        name = self.prefix + key
        with c.pipeline() as pipe:
            try:
                pipe.watch(name)
                old = pipe.get(name)
                if old is not None:
                    try:
                        decode_entry(old, key)
                        return [False]
                    except CorruptEntry:
                        self._count("corrupt")
                pipe.multi()
                pipe.set(name, raw, ex=self.ttl_s)
                pipe.execute()
                return [True]
            except redis.WatchError:  # another client wrote (or deleted) it meanwhile: that stands
                return [False]

    def _delete_unless_replaced(self, c: redis.Redis, key: str, damaged: bytes) -> bytes | None:
        """Delete ``key`` if it still holds ``damaged`` (the bytes just read), and return None. A put
        may replace a damaged value between its read and its deletion (the KV writer saving the page
        a fetch found damaged): that value stays, and is returned when it reads back whole --
        deleting by name would drop it, its page lost from L3 although the writer counted it
        written. ``WATCH`` makes the delete fail if a put lands between the check and the delete.
        Only reads of a damaged value pay this."""
        _, now = self._delete_while(c, self.prefix + key, lambda raw: raw == damaged)
        if now is None:  # deleted, gone, or written meanwhile (read it next time)
            return None
        try:
            return decode_entry(now, key)
        except CorruptEntry:  # damaged too: left to the next read or keep_existing put
            self._count("corrupt")
            return None

    @staticmethod
    def _delete_while(c: redis.Redis, name: str, holds: Callable[[bytes | None], bool]) -> tuple[bool, bytes | None]:
        """Delete ``name`` if ``holds`` its bytes, under ``WATCH``: a put landing between the check and
        the delete makes the delete fail, and that value stands. Returns (deleted, the bytes it
        holds when not deleted; None when deleted, missing or written meanwhile)."""
        with c.pipeline() as pipe:
            try:
                pipe.watch(name)
                now = pipe.get(name)
                if not holds(now):
                    return False, now
                pipe.multi()
                pipe.delete(name)
                return bool(pipe.execute()[0]), None
            except redis.WatchError:  # written meanwhile: that value stands
                return False, None

    def touch(self, keys: list[str]) -> int:
        """One round trip for the whole list: with ``ttl_s`` a pipeline of ``EXPIRE`` (the keys
        live ``ttl_s`` from now), else ``TOUCH`` (refreshes their idle time for Redis' LRU)."""
        for key in keys:
            self._check_key(key)
        if not keys:
            return 0
        names = [self.prefix + k for k in keys]

        def refresh(c: redis.Redis) -> int:
            if self.ttl_s is None:
                return int(c.touch(*names))
            pipe = c.pipeline(transaction=False)
            for name in names:
                pipe.expire(name, self.ttl_s)
            return sum(bool(r) for r in pipe.execute())

        return self._call(refresh) or 0

    def delete(self, key: str) -> bool:
        self._check_key(key)
        return bool(self._call(lambda c: c.delete(self.prefix + key)))

    def delete_unless_changed(self, key: str, value: bytes) -> bool:
        """Under ``WATCH``: the key is deleted only if it still holds ``value`` and nothing writes it
        between the check and the delete."""
        self._check_key(key)

        def holds_value(raw: bytes | None) -> bool:
            try:
                return raw is not None and decode_entry(raw, key) == value
            except CorruptEntry:
                return False

        return bool(self._call(lambda c: self._delete_while(c, self.prefix + key, holds_value)[0]))

    @property
    def available(self) -> bool:
        """False while backing off after failing to reach Redis (a command error does not count)."""
        with self._state_lock:
            return time.monotonic() >= self._down_until

    def close(self) -> None:
        self._client.close()

    # ---- internal helpers -------------------------------------------------------------------

    def _call(self, op: Callable[[redis.Redis], T]) -> T | None:
        """``op``'s result, or None (counted in ``errors``) when it failed; only a failure to reach
        Redis (``_UNREACHABLE``) starts the back-off."""
        if not self.available:
            self._count("skipped")
            return None
        try:
            return op(self._client)
        except _UNREACHABLE:
            with self._state_lock:
                self._down_until = time.monotonic() + self.retry_after_s
            self._count("errors")
            return None
        except redis.RedisError:  # Redis answered, with an error for this command: no back-off
            self._count("errors")
            return None

