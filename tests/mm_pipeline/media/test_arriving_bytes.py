"""The buffer of bytes still arriving (media.arriving_bytes).

What is proven: the incremental key is the key of the same bytes given whole; a reader waits for
bytes and never for good (fail / stall end it with ArrivalAborted, the size is unknown until the
end); whatever the chunking and whenever readers look (before, during, after the end), every read
returns exactly the bytes sent (hypothesis); ``finish`` hands the buffer on without copying it, and
reads after it do not copy it either; a body that failed cannot be finished.
"""

from __future__ import annotations

import io
import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.media.arriving_bytes import ArrivalAborted, ArrivingBytes
from mm_pipeline.media.content_hash import content_key
from tests.support.arriving import feed


def test_arriving_bytes_key_reads_and_size() -> None:
    data = bytes(range(256)) * 40
    body = ArrivingBytes(1 << 20, stall_s=5.0)
    reader = body.reader()
    sender = feed(body, data, chunk=1000)
    assert reader.seek(0, io.SEEK_END) in (-1, len(data))  # unknown (-1) until the end has arrived
    got = b"".join(iter(lambda: reader.read(4096), b""))
    sender.join()
    assert got == data
    whole, key = body.finish()
    assert whole == data and key == content_key(data)
    assert reader.seek(0, io.SEEK_END) == len(data)


def test_arriving_bytes_fail_and_stall_wake_the_reader() -> None:
    body = ArrivingBytes(1 << 20, stall_s=5.0)
    body.feed(b"abc")
    reader = body.reader()
    assert reader.read(10) == b"abc"
    threading.Timer(0.1, body.fail).start()
    t0 = time.monotonic()
    with pytest.raises(ArrivalAborted):
        reader.read(10)  # waits for more, then the receiver gives up
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(ArrivalAborted):
        body.finish()  # a failed body is never handed on (it would be an empty or partial item)
    stalled = ArrivingBytes(1 << 20, stall_s=0.2)
    with pytest.raises(ArrivalAborted, match="no media byte"):
        stalled.reader().read(1)


def test_a_tail_put_in_does_not_count_as_a_stall() -> None:
    """``put_tail`` wakes the waiting readers without a byte arriving: the stall is timed from the
    last byte, so the reader waits on for the body (it took the wake-up for a stall before)."""
    body = ArrivingBytes(1 << 20, stall_s=2.0, declared_size=8)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(body.reader().read(4)))
    reader.start()
    time.sleep(0.1)
    body.put_tail(6, b"gh")
    time.sleep(0.1)
    body.feed(b"abcdef")
    reader.join(5)
    assert got == [b"abcd"]
    stalled = ArrivingBytes(1 << 20, stall_s=0.3)  # and a reader coming late to a silent sender
    stalled.feed(b"ab")
    late = stalled.reader()
    assert late.read(3) == b"ab"
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(ArrivalAborted, match="no media byte"):
        late.read(1)
    assert time.monotonic() - t0 < 0.2  # the sender was silent for stall_s already


def test_arriving_bytes_cap() -> None:
    body = ArrivingBytes(10, stall_s=1.0)
    body.feed(b"x" * 10)
    with pytest.raises(Exception, match="10-byte limit"):
        body.feed(b"y")
    with pytest.raises(ArrivalAborted):
        body.reader().read(1)  # the buffer was freed


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), cuts=st.lists(st.integers(1, 700), min_size=1, max_size=12),
       looks=st.lists(st.tuples(st.integers(0, 3100), st.integers(0, 900)), max_size=8))
def test_every_read_sees_the_bytes_sent(data: bytes, cuts: list[int], looks: list[tuple[int, int]]) -> None:
    """Chunks of any size; after each, and after the end, heads and slices at any offsets equal the
    same slices of the whole; the finished body is the whole, as ``bytes``."""
    body = ArrivingBytes(1 << 16, stall_s=5.0)
    sent, k = 0, 0
    while sent < len(data):
        step = cuts[k % len(cuts)]
        body.feed(data[sent:sent + step])
        sent = min(len(data), sent + step)
        k += 1
        assert body.received == sent
        for start, n in looks:
            assert body.slice(start, start + n) == data[:sent][start:start + n]
            assert body.head(n) == data[:min(n, sent)]
    whole, key = body.finish()
    assert type(whole) is bytes and whole == data and key == content_key(data)
    for start, n in looks:
        assert body.slice(start, start + n) == data[start:start + n]
    reader = body.reader()
    assert reader.read() == data


def test_finish_and_later_reads_do_not_copy_the_body() -> None:
    """8 MiB arrive; ``finish`` and the reads an early decoder still makes after it allocate a
    small fraction of that (a ``bytes(bytearray)`` at the end allocated all of it again)."""
    size = 8 << 20
    chunk = bytes(range(256)) * 256  # 64 KiB
    tracemalloc.start()  # from the first byte: growing the buffer in place is then not a new block
    try:
        body = ArrivingBytes(size, stall_s=5.0)
        for _ in range(size // len(chunk)):
            body.feed(chunk)
        reader = body.reader()
        reader.seek(size // 2)
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        whole, _ = body.finish()
        assert len(reader.read(1 << 16)) == 1 << 16 and body.head(1 << 16) == whole[:1 << 16]
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(whole) == size and peak < size // 8, f"finishing allocated {peak} bytes for a {size}-byte body"
    assert body.finish()[0] is whole
