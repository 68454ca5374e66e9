"""Content keys for the encoder cache and the prefix cache, computed from the raw encoded bytes
before anything else looks at them (sniff, probe, decode), so a repeated item skips all of those,
preprocessing and the encoder.

The raw bytes are hashed exactly once, at ingest; every other key is derived from that digest and
covers everything that changes the encoder output:

    content_key = blake3( raw bytes )                      (plain: equals the upload store's hash)
    media_key  = blake3( "mmserve.media.v2" | kind | encoder_id | params | content_key )
                 (a request with a cache_salt: blake3( "mmserve.media.salted.v1" | media_key | salt ))
    group_key  = blake3( "mmserve.video-group.v1" | media_key | sampling params | group index )
    segment_key= blake3( "mmserve.audio-segment.v1" | media_key | audio params | segment index )

Every field is length-prefixed (no two field lists serialise to the same byte string) and params
are canonical JSON (sorted keys, no whitespace), so dict order and float spelling do not matter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import OrderedDict
from typing import Any, Mapping

import blake3

from mm_pipeline.media.types import MediaKind

# Below this size the single-threaded hasher is faster than spinning up blake3's thread pool.
_PARALLEL_HASH_BYTES = 1 << 22


def canonical_params(params: Mapping[str, Any] | Any) -> bytes:
    """Canonical JSON of a mapping or dataclass of JSON scalars / lists / nested mappings (a
    dataclass anywhere in it reads as ``dataclasses.asdict`` of it).

    Raises ``TypeError`` for values with no stable encoding (tensors, objects) and ``ValueError``
    for NaN / infinity, which would make equal configurations hash differently."""
    if _is_instance(params):
        return _config_form(params)[1]
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping or a dataclass instance, got {type(params).__name__}")
    return _dumps(_normalise(params))


def _dumps(form: Any) -> bytes:
    return json.dumps(form, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _is_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


# The normal form and canonical JSON of config dataclasses, remembered by identity: the image,
# sampling and audio configs are the same frozen objects for a runtime's life, and asdict + JSON of
# them was ~60 % of the keys' cost (a video's media key and one group key per frame group, every
# request: ~0.15 ms of a same-prefix request's hop). Only hashable instances (frozen, immutable
# fields) are remembered; the entry holds the object, so its id cannot be reused while remembered.
_REMEMBERED = 64
_remembered: OrderedDict[int, tuple[Any, Any, bytes]] = OrderedDict()
_remembered_lock = threading.Lock()


def _config_form(value: Any) -> tuple[Any, bytes]:
    """(normal form, canonical JSON) of a dataclass instance."""
    try:
        hash(value)
    except TypeError:  # mutable: computed every time
        form = _normalise(dataclasses.asdict(value))
        return form, _dumps(form)
    with _remembered_lock:
        hit = _remembered.get(id(value))
        if hit is not None and hit[0] is value:
            _remembered.move_to_end(id(value))
            return hit[1], hit[2]
    form = _normalise(dataclasses.asdict(value))
    blob = _dumps(form)
    with _remembered_lock:
        _remembered[id(value)] = (value, form, blob)
        while len(_remembered) > _REMEMBERED:
            _remembered.popitem(last=False)
    return form, blob


def _normalise(value: Any) -> Any:
    if _is_instance(value):
        return _config_form(value)[0]
    if isinstance(value, Mapping):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, MediaKind):
        return value.value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"params hold a non-finite float {value!r}")
        return int(value) if value.is_integer() else value  # 1.0 and 1 configure the same thing
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"params value of type {type(value).__name__} has no canonical encoding")


def _digest(domain: str, *fields: bytes) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if sum(map(len, fields)) > _PARALLEL_HASH_BYTES else 1)
    for part in (domain.encode(), *fields):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def content_key(data: bytes | bytearray | memoryview) -> str:
    """blake3 of the raw encoded bytes (blake3's own threads on large items): the one hash of the
    bytes; the keys below derive from it."""
    threads = blake3.blake3.AUTO if len(data) > _PARALLEL_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def media_key(content: str, kind: MediaKind, params: Mapping[str, Any] | Any | bytes, encoder_id: str) -> str:
    """Key of one media item's encoder output: the bytes' ``content_key`` + kind + preprocessing
    params + the encoder weights id (change the checkpoint → new keys). ``params`` may be given as
    its ``canonical_params`` bytes, computed once by a caller that keys every item with the same."""
    if not encoder_id:
        raise ValueError("encoder_id must name the encoder weights (e.g. checkpoint hash)")
    if len(content) != 64:
        raise ValueError(f"media_key wants a content_key (64 hex digits), got {content[:16]!r}...")
    form = params if isinstance(params, bytes) else canonical_params(params)
    return _digest("mmserve.media.v2", kind.value.encode(), encoder_id.encode(), form, content.encode())


def salted_media_key(mkey: str, salt: str | None) -> str:
    """``mkey`` as a request with ``cache_salt`` keys it: every key derived from it (frame groups,
    audio segments, the manifest) then differs per salt, so the encoder cache, its tiers and the
    planning a request joins are shared only between requests of the same salt. None: ``mkey``."""
    if salt is None:
        return mkey
    return _digest("mmserve.media.salted.v1", mkey.encode(), salt.encode("utf-8", "surrogatepass"))


def video_group_key(media: str, sampling: Mapping[str, Any] | Any, group_index: int) -> str:
    """Key of one temporal group (a pair of sampled frames) of a video."""
    if group_index < 0:
        raise ValueError(f"group_index must be >= 0, got {group_index}")
    return _digest("mmserve.video-group.v1", media.encode(), canonical_params(sampling),
                   str(group_index).encode())


def audio_segment_key(media: str, audio_params: Mapping[str, Any] | Any, segment_index: int) -> str:
    """Key of one encoder segment of an audio item (e.g. 6000 mel frames each)."""
    if segment_index < 0:
        raise ValueError(f"segment_index must be >= 0, got {segment_index}")
    return _digest("mmserve.audio-segment.v1", media.encode(), canonical_params(audio_params),
                   str(segment_index).encode())
