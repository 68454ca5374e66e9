"""MP4 files reshaped the way other writers lay them out, for the layout and early-decode tests:
where a top-level box is, a box put before the samples (camera metadata), an index grown to
megabytes (a long video's). Each moves the samples, so every chunk offset of the index (``stco``
/ ``co64``) is moved with them and the file still decodes to the same frames."""

from __future__ import annotations


def box_at(data: bytes, kind: bytes = b"moov") -> int:
    """Offset of the first top-level box of ``kind``."""
    pos = 0
    while data[pos + 4:pos + 8] != kind:
        pos += int.from_bytes(data[pos:pos + 4], "big")
    return pos


def _box(kind: bytes, payload: bytes) -> bytes:
    return (8 + len(payload)).to_bytes(4, "big") + kind + payload


def _moved_chunks(moov: bytes, shift: int) -> bytearray:
    """``moov`` with every chunk offset of every track plus ``shift``."""
    out = bytearray(moov)

    def walk(start: int, end: int) -> None:
        pos = start
        while pos + 8 <= end:
            size, kind = int.from_bytes(out[pos:pos + 4], "big"), bytes(out[pos + 4:pos + 8])
            if kind in (b"moov", b"trak", b"mdia", b"minf", b"stbl"):
                walk(pos + 8, pos + size)
            elif kind in (b"stco", b"co64"):
                width = 4 if kind == b"stco" else 8
                count = int.from_bytes(out[pos + 12:pos + 16], "big")
                for i in range(pos + 16, pos + 16 + count * width, width):
                    out[i:i + width] = (int.from_bytes(out[i:i + width], "big") + shift).to_bytes(width, "big")
            pos += size

    walk(0, len(out))
    return out


def with_box_before_samples(data: bytes, kind: bytes, payload: bytes) -> bytes:
    """``data`` (index last) with a ``kind`` box just before its ``mdat``: what cameras write
    (metadata boxes of kilobytes before the samples)."""
    mdat, at = box_at(data, b"mdat"), box_at(data)
    box = _box(kind, payload)
    return data[:mdat] + box + data[mdat:at] + bytes(_moved_chunks(data[at:], len(box)))


def with_bigger_index(data: bytes, extra: int) -> bytes:
    """``data`` (index first) with its ``moov`` grown by a ``free`` box of ``extra`` bytes at its end
    (the demuxer skips it): the size of a long video's sample tables, before the samples."""
    at = box_at(data)
    size = int.from_bytes(data[at:at + 4], "big")
    pad = _box(b"free", bytes(extra - 8))
    moov = _moved_chunks(data[at:at + size], len(pad))
    moov[0:4] = (size + len(pad)).to_bytes(4, "big")
    return data[:at] + bytes(moov) + pad + data[at + size:]
