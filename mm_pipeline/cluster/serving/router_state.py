"""The router's memory of which replica was sent which prefix: a radix tree of dispatched prefixes.

Prefixes are chains of block hashes (mm_pipeline/cluster/serving/route_key.py): hash ``i`` stands for the
whole path from the root to block ``i``, so the tree is stored flat, one entry per node naming the
replicas that were sent that path. A lookup walks the request's chain from the root and stops, per
replica, at the first node it is missing from: that depth is the replica's matched prefix.

Two stores with one contract:

* :class:`MemoryPrefixIndex` -- in the router's process, each replica's nodes in LRU order and
  capped (``max_blocks_per_replica``), a model of the replica's own cache evicting old prefixes;
* :class:`RedisPrefixIndex` -- the same nodes as Redis sets (``b:<hash>`` -> replicas, and
  ``t:<replica>`` -> its hashes, a sorted set scored by when each was last sent, so a dead replica
  can be forgotten), with a TTL standing in for eviction: a node expires ``ttl_s`` after it was
  last sent, and each record trims the replica's hashes older than that (a plain set of them, whose
  TTL every request renewed, grew for the replica's whole life). Several ingress replicas share it and so agree on where a prefix went; a restarted
  ingress keeps it. Redis being down is a miss (routing falls back to load), never an error, like
  every other Redis tier in mmserve (llm_core/storage/redis_store.py).

The router calls the index on its asyncio event loop (Ray Serve runs routers on the handle's loop),
where one Redis round trip -- up to the 0.25 s socket timeout when Redis is slow -- would stall
every request routed through that ingress. So the loop uses ``lookup`` (awaited) and never ``match``:
the Redis index runs it on its own reader thread, waits at most ``lookup_timeout_s`` and takes a
timeout as a miss; ``record`` and ``forget`` only queue the write for one writer thread
(mm_pipeline/cluster/serving/write_behind.py: in order, bounded, the oldest dropped when full).
A write is seen by lookups once the writer ran it (``flush`` waits for that): well before a
conversation's next turn, and a dropped one only costs a later miss. The memory index answers
``lookup`` inline and applies writes when made: there is no I/O to wait on, so no thread hop either.

And :class:`InflightWork`, the work each router (this one and the encoders') has sent to each
replica and not yet seen finish.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Iterable, Protocol, Sequence

from mm_pipeline.cluster.serving.write_behind import WriteBehind

log = logging.getLogger(__name__)


class PrefixIndex(Protocol):
    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """``replica`` was sent the prefix ``hashes`` (all its nodes, root first). Never waits on I/O:
        a remote index queues the write (see ``flush``)."""

    def match(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each of ``replicas``: how many leading blocks of ``hashes`` it was sent. May wait on
        I/O: not for an event loop (use ``lookup``)."""

    async def lookup(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """``match`` for an event loop: never blocks it, bounded in time; a timeout is a miss."""

    def forget(self, replica: str) -> None:
        """Drop every node of a replica that died or left. Never waits on I/O, and is applied after
        every ``record`` made before it."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the writes made so far are applied (or dropped); False on timeout."""

    def close(self) -> None:
        """Stop the index's threads, if it has any."""


def walk(hashes: Sequence[int], holders: Sequence[set[str]], replicas: Iterable[str]) -> dict[str, int]:
    """Depth reached by each replica walking down the chain (``holders[i]``: who holds node i)."""
    depth = {r: 0 for r in replicas}
    alive = set(depth)
    for i, held in enumerate(holders[:len(hashes)]):
        alive &= held
        if not alive:
            break
        for r in alive:
            depth[r] = i + 1
    return depth


class MemoryPrefixIndex:
    """The index in this process (one router, or the benchmark's simulation)."""

    def __init__(self, max_blocks_per_replica: int | None = None) -> None:
        if max_blocks_per_replica is not None and max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be >= 1, got {max_blocks_per_replica}")
        self.cap = max_blocks_per_replica
        self._nodes: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._lock = threading.Lock()  # the Serve router calls back from its own loop and threads

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        with self._lock:
            lru = self._lru.setdefault(replica, OrderedDict())
            for h in hashes:
                self._nodes.setdefault(h, set()).add(replica)
                lru[h] = None
                lru.move_to_end(h)
            while self.cap is not None and len(lru) > self.cap:
                old, _ = lru.popitem(last=False)
                self._drop(old, replica)

    def match(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return walk(hashes, [self._nodes.get(h, set()) for h in hashes], replicas)

    async def lookup(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        return self.match(hashes, replicas)  # no I/O: inline, without suspending the caller

    def forget(self, replica: str) -> None:
        with self._lock:
            for h in self._lru.pop(replica, {}):
                self._drop(h, replica)

    def flush(self, timeout_s: float | None = None) -> bool:
        return True  # writes are applied when made

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        """Each node names exactly the replicas whose LRU holds it, no node is empty, no LRU is over
        the cap. Raises AssertionError naming the first difference."""
        with self._lock:
            expect: dict[int, set[str]] = {}
            for replica, lru in self._lru.items():
                if self.cap is not None and len(lru) > self.cap:
                    raise AssertionError(f"replica {replica} holds {len(lru)} blocks, cap {self.cap}")
                for h in lru:
                    expect.setdefault(h, set()).add(replica)
            if expect != self._nodes:
                bad = next(h for h in set(expect) | set(self._nodes) if expect.get(h) != self._nodes.get(h))
                raise AssertionError(f"node {bad}: holders {self._nodes.get(bad)}, LRUs say {expect.get(bad)}")

    def blocks(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def _drop(self, h: int, replica: str) -> None:
        held = self._nodes.get(h)
        if held is not None:
            held.discard(replica)
            if not held:
                del self._nodes[h]


class RedisPrefixIndex:
    """The index in Redis (see module doc). ``ttl_s``: how long a node lives after it was last sent;
    ``timeout_s``: each socket operation's; ``lookup_timeout_s`` (default ``timeout_s``): the most a
    ``lookup`` waits; ``max_pending_writes``: the writer's queue."""

    def __init__(self, url: str, *, prefix: str = "mmserve:router:", ttl_s: int = 3600,
                 timeout_s: float = 0.25, retry_after_s: float = 5.0, lookup_timeout_s: float | None = None,
                 max_pending_writes: int = 4096) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from llm_core.storage.redis_store import RedisAddress

        a = RedisAddress.from_url(url)
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        self.prefix, self.ttl_s, self.retry_after_s = prefix, ttl_s, retry_after_s
        self.lookup_timeout_s = timeout_s if lookup_timeout_s is None else lookup_timeout_s
        self.lookup_timeouts = 0  # lookups that gave up waiting (each a miss)
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis(host=a.host, port=a.port, db=a.db, username=a.username, password=a.password,
                                   socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._down_until = 0.0
        self._closed = False
        # one reader thread: a slow Redis then holds one connection, and lookups queued behind it
        # time out on the caller's side and are cancelled before they start
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-index-read")
        self._writer = WriteBehind("prefix-index-write", max_pending_writes)

    @property
    def dropped_writes(self) -> int:
        return self._writer.dropped

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._writer.submit(partial(self._call, self._record_now, replica, tuple(hashes)))

    def forget(self, replica: str) -> None:
        self._writer.submit(partial(self._call, self._forget_now, replica))

    def match(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        holders = self._call(self._holders_now, hashes) if hashes else []
        return walk(hashes, holders or [], replicas)

    async def lookup(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        replicas = list(replicas)  # the caller's mapping may change while the reader works
        if not hashes or self._closed or time.monotonic() < self._down_until:
            return walk(hashes, [], replicas)  # known down: a miss without a thread hop
        try:
            job = self._reader.submit(self._call, self._holders_now, tuple(hashes))
        except RuntimeError:  # closed meanwhile
            return walk(hashes, [], replicas)
        try:
            # cancelling the wrapper on timeout cancels the job too, if it has not started
            holders = await asyncio.wait_for(asyncio.wrap_future(job), self.lookup_timeout_s)
        except asyncio.TimeoutError:
            self.lookup_timeouts += 1
            holders = None
        return walk(hashes, holders or [], replicas)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._writer.flush(timeout_s)

    def close(self, drain_s: float = 1.0) -> None:
        """Apply the queued writes for up to ``drain_s``, stop both threads, close the connections."""
        self._closed = True
        self._writer.close(drain_s)
        self._reader.shutdown(wait=True, cancel_futures=True)  # a read in flight ends by its socket timeout
        self._client.close()

    def _record_now(self, c, replica: str, hashes: tuple[int, ...]) -> None:
        now = time.time()
        pipe = c.pipeline(transaction=False)
        for h in hashes:
            pipe.sadd(self._b(h), replica)
            pipe.expire(self._b(h), self.ttl_s)
        pipe.zadd(self._r(replica), {str(h): now for h in hashes})
        pipe.zremrangebyscore(self._r(replica), "-inf", now - self.ttl_s)  # their nodes expired
        pipe.expire(self._r(replica), self.ttl_s)
        pipe.execute()

    def _holders_now(self, c, hashes: Sequence[int]) -> list[set[str]]:
        pipe = c.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(self._b(h))
        return [set(s) for s in pipe.execute()]

    def _forget_now(self, c, replica: str) -> None:
        members = c.zrange(self._r(replica), 0, -1)
        pipe = c.pipeline(transaction=False)
        for h in members:
            pipe.srem(self._b(int(h)), replica)
        pipe.delete(self._r(replica))
        pipe.execute()

    def _b(self, h: int) -> str:
        return f"{self.prefix}b:{h}"

    def _r(self, replica: str) -> str:
        return f"{self.prefix}t:{replica}"

    def _call(self, op, *args):
        """``op(client, *args)``, or None while Redis is down (then for ``retry_after_s``)."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return op(self._client, *args)
        except self._errors as exc:
            log.warning("router state in Redis unavailable for %.0fs: %s", self.retry_after_s, exc)
            self._down_until = time.monotonic() + self.retry_after_s
            return None


class InflightWork:
    """Work sent to each replica and not seen finish, by request id (tokens of prefill, or 1 per call).

    Ray Serve may report a request completed before it reports it routed: its done-callback is set
    before it waits for the replica to accept, and both reach the router through the event loop
    (a request refused at once, a one-token answer). A completion for a request not routed yet is
    remembered (the last ``max_early``), and that request's routing then adds nothing -- else its
    work stayed counted on the replica for good and the replica looked busier with every such one.
    """

    def __init__(self, max_early: int = 4096) -> None:
        self.by_replica: dict[str, int] = {}
        self._requests: dict[str, tuple[str, int]] = {}
        self._early: OrderedDict[str, None] = OrderedDict()
        self._max_early = max_early

    def get(self, replica: str) -> int:
        return self.by_replica.get(replica, 0)

    def routed(self, request: str, replica: str, work: int) -> None:
        if request in self._early:
            del self._early[request]
            return
        self.by_replica[replica] = self.get(replica) + work
        self._requests[request] = (replica, work)

    def completed(self, request: str) -> None:
        found = self._requests.pop(request, None)
        if found is None:
            self._early[request] = None
            while len(self._early) > self._max_early:
                self._early.popitem(last=False)
            return
        replica, work = found
        self.by_replica[replica] = max(0, self.get(replica) - work)

    def forget(self, replicas: Iterable[str]) -> None:
        """Replicas that are gone: their counts and their requests' entries."""
        gone = set(replicas)
        for replica in gone:
            self.by_replica.pop(replica, None)
        for request in [q for q, (replica, _) in self._requests.items() if replica in gone]:
            del self._requests[request]
