"""llm_core.storage.RedisStore: damaged values, a full or failing server, an unreachable or silent one
(fast misses), and the URLs it is configured with."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from llm_core.storage import RedisAddress, RedisStore
from tests.conftest import running_redis


# ---- redis ----------------------------------------------------------------------------------

def test_redis_damaged_value_is_a_miss_and_removed(redis_server: int) -> None:
    import redis

    s = RedisStore(port=redis_server, prefix="dmg:")
    s.put("k", b"value")
    client = redis.Redis(port=redis_server)
    client.set("dmg:k", b"not an entry")
    assert s.get("k") is None
    assert client.get("dmg:k") is None


@pytest.fixture(scope="module")
def full_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Port of a redis-server of its own with a tiny ``maxmemory`` and the ``noeviction`` policy (Redis'
    default): once full it answers every write with OOM and keeps serving reads."""
    with running_redis(tmp_path_factory.mktemp("full-redis"), "--maxmemory", "3mb",
                       "--maxmemory-policy", "noeviction") as port:
        yield port


def test_redis_at_maxmemory_fails_the_write_and_keeps_serving_reads(full_redis: int) -> None:
    import redis

    s = RedisStore(port=full_redis, prefix="full:", retry_after_s=60)
    assert s.put("kept", b"v" * 100)
    client = redis.Redis(port=full_redis)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for i in range(10_000):  # other data fills it
            client.set(f"filler:{i}", b"x" * 65536)
    # Redis admits a write while just under the limit: the store's own puts soon get OOM too
    assert not all(s.put(f"more:{i}", b"v" * 65536) for i in range(100))
    assert s.available  # a failed write from a server that answers: no back-off
    assert s.get("kept") == b"v" * 100  # the reads go on
    assert s.stats["errors"] == 1 and s.stats.get("skipped", 0) == 0
    s.close()
    client.close()


def test_redis_command_error_fails_only_that_command(redis_server: int) -> None:
    import redis

    prefix = f"t-{uuid.uuid4().hex}:"
    s = RedisStore(port=redis_server, prefix=prefix, retry_after_s=60)
    assert s.put("ok", b"value")
    redis.Redis(port=redis_server).lpush(prefix + "list", b"x")  # a foreign list under one of our keys
    assert s.get("list") is None  # WRONGTYPE: a miss...
    assert s.available and s.get("ok") == b"value"  # ...and the next command is served
    assert s.stats["errors"] == 1 and s.stats.get("skipped", 0) == 0


def test_redis_unreachable_is_a_fast_miss() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = RedisStore(port=port, timeout_s=0.2, retry_after_s=60)
    t0 = time.perf_counter()
    assert s.get("k") is None
    assert not s.put("k", b"v")
    assert time.perf_counter() - t0 < 1.0
    assert s.stats["errors"] == 1 and s.stats["skipped"] == 1  # backed off after the first failure
    assert not s.available


def test_redis_silent_server_times_out_as_a_miss() -> None:
    with socket.socket() as server:  # accepts connections, never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        s = RedisStore(port=server.getsockname()[1], timeout_s=0.2, retry_after_s=0)
        t0 = time.perf_counter()
        assert s.get("k") is None
        elapsed = time.perf_counter() - t0
    assert 0.15 < elapsed < 1.5
    assert s.stats["errors"] == 1


# ---- Redis URLs -----------------------------------------------------------------------------

def test_redis_url_parses_host_port_db_and_credentials() -> None:
    assert RedisAddress.from_url("redis://") == RedisAddress("127.0.0.1", 6379, 0)
    assert RedisAddress.from_url("redis://cache.local:6380/2") == RedisAddress("cache.local", 6380, 2)
    assert RedisAddress.from_url(" REDIS://[::1]/15 ") == RedisAddress("::1", 6379, 15)
    a = RedisAddress.from_url("redis://alice:p%40ss@h:1/3")
    assert (a.username, a.password, a.host, a.port, a.db) == ("alice", "p@ss", "h", 1, 3)
    assert "p@ss" not in repr(a)


@pytest.mark.parametrize("url, problem", [
    ("localhost:6379", "must start with redis://"),
    ("rediss://h:6379/0", "must start with redis://"),
    ("http://h/0", "must start with redis://"),
    ("redis://h:port/0", "bad port"),
    ("redis://h:70000", "bad port"),
    ("redis://h:0", "port must be in 1..65535"),
    ("redis://h/x", "database after the host must be a number"),
    ("redis://h/-1", "database after the host must be a number"),
    ("redis://h/1/2", "database after the host must be a number"),
    ("redis://h/0?ssl=true", "query parameters"),
])
def test_redis_url_errors_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RedisAddress.from_url(url)
    with pytest.raises(ValueError, match=problem):
        RedisStore.from_url(url)


def test_redis_url_error_hides_the_password() -> None:
    with pytest.raises(ValueError) as err:
        RedisAddress.from_url("redis://bob:hunter2@h/db0")
    assert "hunter2" not in str(err.value) and "bob:***@h" in str(err.value)


def test_redis_store_from_url_talks_to_that_server(redis_server: int) -> None:
    a = RedisStore.from_url(f"redis://127.0.0.1:{redis_server}/1", prefix="url:")
    b = RedisStore(port=redis_server, db=1, prefix="url:")
    other_db = RedisStore(port=redis_server, db=2, prefix="url:")
    assert a.put("k", b"v")
    assert b.get("k") == b"v" and other_db.get("k") is None
    for s in (a, b, other_db):
        s.close()
