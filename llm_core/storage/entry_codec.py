"""Self-checking entry format for stores whose bytes can be damaged (disk, network, other
processes): a stored entry carries its own key and a blake3 checksum, so a torn write, a flipped
bit, a truncated file or two keys colliding on one file name all read back as a miss.

    0      4     8        16        24                     56        56+K
    ┌──────┬─────┬────────┬─────────┬──────────────────────┬─────────┬──────────────┐
    │ MMKV │ v=1 │ len(K) │ len(V)  │ blake3(lenK|K|V) 32B │ key K   │ value V      │
    └──────┴─────┴────────┴─────────┴──────────────────────┴─────────┴──────────────┘
      magic  u32   u64 LE   u64 LE
"""

from __future__ import annotations

import struct

import blake3

MAGIC = b"MMKV"
VERSION = 1
_HEADER = struct.Struct("<4sIQQ32s")
HEADER_BYTES = _HEADER.size  # 56


class CorruptEntry(ValueError):
    """Raised by ``decode_entry``: the bytes are not an intact entry for the requested key."""


def _checksum(key: bytes, value: bytes | memoryview) -> bytes:
    h = blake3.blake3()
    h.update(len(key).to_bytes(8, "little"))
    h.update(key)
    h.update(value)
    return h.digest()


def encode_entry(key: str, value: bytes) -> bytes:
    """Wrap ``value`` with a header naming ``key`` and a checksum over both."""
    k = key.encode()
    return _HEADER.pack(MAGIC, VERSION, len(k), len(value), _checksum(k, value)) + k + value


def decode_entry(raw: bytes, key: str) -> bytes:
    """Return the value stored in ``raw``; raise ``CorruptEntry`` saying what is wrong when it is
    truncated, damaged, of another format version, or stored under a different key."""
    if len(raw) < HEADER_BYTES:
        raise CorruptEntry(f"entry of {len(raw)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, version, klen, vlen, checksum = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry(f"bad magic/version {magic!r}/{version}")
    if len(raw) != HEADER_BYTES + klen + vlen:
        raise CorruptEntry(f"entry is {len(raw)} bytes, header says {HEADER_BYTES + klen + vlen}")
    view = memoryview(raw)
    k = bytes(view[HEADER_BYTES:HEADER_BYTES + klen])
    if k != key.encode():
        raise CorruptEntry(f"entry holds key {k[:80]!r}, not the requested one")
    value = view[HEADER_BYTES + klen:]
    if _checksum(k, value) != checksum:
        raise CorruptEntry("checksum mismatch")
    return bytes(value)
