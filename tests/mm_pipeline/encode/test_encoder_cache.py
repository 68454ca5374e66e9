"""mm_pipeline encoder cache: tier promotion, persistence, damaged entries, Redis tier, and the
content keys it is addressed by (single flight: test_single_flight.py)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.storage import LocalDirStore, MemoryStore, RedisStore, encode_entry
from mm_pipeline.media.content_hash import (audio_segment_key, canonical_params, content_key, media_key,
                                              salted_media_key, video_group_key)
from mm_pipeline.encode.encoder_cache import EncoderCache, tensor_from_bytes, tensor_to_bytes
from mm_pipeline.media.types import MediaKind
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams


def _emb(seed: int, rows: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cache(tmp_path: Path, memory_bytes: int = 1 << 20, *extra: object) -> EncoderCache:
    return EncoderCache([MemoryStore(memory_bytes), LocalDirStore(tmp_path / "disk"), *extra])  # type: ignore[list-item]


# ---- content keys ---------------------------------------------------------------------------

def test_media_key_is_stable_and_covers_every_input() -> None:
    base = media_key(content_key(b"bytes"), MediaKind.IMAGE, {"max_pixels": 1024, "mean": [0.5, 0.25]}, "vit@abc")
    assert base == media_key(content_key(b"bytes"), MediaKind.IMAGE, {"mean": [0.5, 0.25], "max_pixels": 1024.0}, "vit@abc")
    # Pinned: persisted caches (disk, Redis) outlive the process, so the key format must not drift
    # silently.  Changing it is a deliberate version bump of the "mmserve.media.v2" domain tag.
    assert base == "c08dc364cfcf48421716fc50ddfccab63f155bb7263b5282a6e74c54f413a785"
    # the params' canonical bytes (computed once by the planner) key the same
    assert base == media_key(content_key(b"bytes"), MediaKind.IMAGE,
                             canonical_params({"max_pixels": 1024, "mean": [0.5, 0.25]}), "vit@abc")
    # the content key is plain blake3 of the bytes (what the upload store names its blobs by)
    assert content_key(b"bytes") == blake3.blake3(b"bytes").hexdigest()
    assert content_key(bytes(5 << 20)) == blake3.blake3(bytes(5 << 20)).hexdigest()  # threaded path
    with pytest.raises(ValueError, match="content_key"):
        media_key("short", MediaKind.IMAGE, {}, "vit")
    assert video_group_key("ab" * 32, {"fps": 1.0}, 3) == (
        "cd6f7ced77fdc190ee736e61ed3c30631b6c7d6a9fbf29efe504e1b6999de751")
    variants = [
        media_key(content_key(b"bytez"), MediaKind.IMAGE, {"max_pixels": 1024, "mean": [0.5, 0.25]}, "vit@abc"),
        media_key(content_key(b"bytes"), MediaKind.VIDEO, {"max_pixels": 1024, "mean": [0.5, 0.25]}, "vit@abc"),
        media_key(content_key(b"bytes"), MediaKind.IMAGE, {"max_pixels": 1025, "mean": [0.5, 0.25]}, "vit@abc"),
        media_key(content_key(b"bytes"), MediaKind.IMAGE, {"max_pixels": 1024, "mean": [0.5, 0.25]}, "vit@abd"),
    ]
    assert len({base, *variants}) == 5


@given(a=st.binary(max_size=40), b=st.binary(max_size=40), pa=st.text(max_size=8), pb=st.text(max_size=8))
def test_media_key_fields_cannot_be_shifted_into_each_other(a: bytes, b: bytes, pa: str, pb: str) -> None:
    same = (a, pa) == (b, pb)
    assert (media_key(content_key(a), MediaKind.IMAGE, {"p": pa}, "e") == media_key(content_key(b), MediaKind.IMAGE, {"p": pb}, "e")) == same
    assert (media_key(content_key(a), MediaKind.IMAGE, {}, "e" + pa) == media_key(content_key(b), MediaKind.IMAGE, {}, "e" + pb)) == same


@given(a=st.text(min_size=1, max_size=12), b=st.text(min_size=1, max_size=12))
def test_a_salt_keys_media_apart_and_none_leaves_the_key(a: str, b: str) -> None:
    """cache_salt: one media item, one key per salt (its frame groups too); no salt, the plain key."""
    m = media_key(content_key(b"image"), MediaKind.IMAGE, {}, "vit")
    assert salted_media_key(m, None) == m and salted_media_key(m, a) != m
    assert (salted_media_key(m, a) == salted_media_key(m, b)) == (a == b)
    sampling = VideoSamplingParams()
    assert (video_group_key(salted_media_key(m, a), sampling, 0) == video_group_key(m, sampling, 0)) is False


def test_group_and_segment_keys() -> None:
    m = media_key(content_key(b"video"), MediaKind.VIDEO, {}, "vit")
    sampling = VideoSamplingParams()
    groups = {video_group_key(m, sampling, g) for g in range(50)}
    assert len(groups) == 50
    assert video_group_key(m, sampling, 3) == video_group_key(m, VideoSamplingParams(), 3)
    assert video_group_key(m, VideoSamplingParams(fps=2.0), 3) != video_group_key(m, sampling, 3)
    segs = {audio_segment_key(m, {"rate": 24000, "segment": 6000}, s) for s in range(10)}
    assert len(segs) == 10 and not segs & groups
    with pytest.raises(ValueError, match="group_index"):
        video_group_key(m, sampling, -1)


def test_canonical_params_rejects_unstable_values() -> None:
    assert canonical_params({"b": 1, "a": [1.0, "x"]}) == b'{"a":[1,"x"],"b":1}'
    with pytest.raises(ValueError, match="non-finite"):
        canonical_params({"x": float("nan")})
    with pytest.raises(TypeError, match="Tensor"):
        canonical_params({"x": torch.zeros(1)})


def test_config_objects_give_the_keys_their_asdict_gives_and_are_remembered_only_while_immutable() -> None:
    # keys persist in the disk and Redis tiers: passing the config objects (remembered by identity)
    # must give byte for byte what their asdict gave
    from dataclasses import asdict, dataclass, field

    from encoders.config import AudioConfig
    from encoders.image_processing import ImageProcessingConfig
    from mm_pipeline.media import content_hash

    img, sampling, audio = ImageProcessingConfig(), VideoSamplingParams(fps=1.5), AudioConfig()
    objects = {"image": img, "sampling": sampling, "sound": audio}
    dicts = {"image": asdict(img), "sampling": asdict(sampling), "sound": asdict(audio)}
    for _ in range(2):  # computed, then remembered
        assert canonical_params(objects) == canonical_params(dicts)
        assert canonical_params(sampling) == canonical_params(asdict(sampling))
        assert media_key(content_key(b"v"), MediaKind.VIDEO, objects, "e") == \
            media_key(content_key(b"v"), MediaKind.VIDEO, dicts, "e")
    assert content_hash._remembered[id(sampling)][0] is sampling
    # an equal but distinct object is its own entry; a changed config is a new object: a new key
    assert canonical_params(VideoSamplingParams(fps=1.5)) == canonical_params(sampling)
    assert canonical_params(VideoSamplingParams(fps=2.0)) != canonical_params(sampling)

    @dataclass
    class Mutable:  # unhashable: computed every time, never remembered
        sizes: list = field(default_factory=lambda: [1])

    m = Mutable()
    before = canonical_params(m)
    m.sizes.append(2)
    assert canonical_params(m) != before and id(m) not in content_hash._remembered


# ---- tiers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = _emb(1, dtype=dtype)
    back = tensor_from_bytes(tensor_to_bytes(t))
    assert back.dtype == dtype and torch.equal(back, t)
    with pytest.raises(ValueError, match="not a serialised tensor"):
        tensor_from_bytes(b"junk")


def test_put_get_promotion_and_stats(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    assert cache.get("k") is None
    cache.put("k", _emb(1))
    assert torch.equal(cache.get("k"), _emb(1))
    cache.flush()
    assert cache.stats()["hits"] == {"memory": 1, "disk": 0}
    cache.close()

    fresh = _cache(tmp_path)  # new process: empty memory, same directory
    assert torch.equal(fresh.get("k"), _emb(1))  # from disk → promoted to memory
    assert torch.equal(fresh.get("k"), _emb(1))  # from memory
    assert fresh.stats()["hits"] == {"memory": 1, "disk": 1}
    assert fresh.stats()["misses"] == 0
    fresh.check_integrity()
    fresh.close()


def test_returned_tensors_are_copies(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    cache.put("k", _emb(2))
    cache.get("k").zero_()
    assert torch.equal(cache.get("k"), _emb(2))
    cache.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign-content"])
def test_damaged_disk_entry_is_a_miss(tmp_path: Path, damage: str) -> None:
    cache = _cache(tmp_path)
    cache.put("k", _emb(3))
    cache.close()
    (path,) = (tmp_path / "disk").glob("??/*.entry")
    raw = path.read_bytes()
    path.write_bytes({
        "truncate": raw[:-7],
        "flip": raw[:100] + bytes([raw[100] ^ 0x40]) + raw[101:],
        "foreign-content": encode_entry("enc:k", b"intact entry, not a tensor"),
    }[damage])
    fresh = _cache(tmp_path)
    assert fresh.get("k") is None
    assert not path.exists()
    assert fresh.stats()["misses"] == 1
    fresh.check_integrity()
    fresh.close()


def test_memory_budget_falls_back_to_disk(tmp_path: Path) -> None:
    one = len(tensor_to_bytes(_emb(0)))
    cache = _cache(tmp_path, 2 * one)
    for i in range(5):
        cache.put(f"k{i}", _emb(i))
    cache.flush()
    assert all(torch.equal(cache.get(f"k{i}"), _emb(i)) for i in range(5))
    hits = cache.stats()["hits"]
    assert hits["disk"] >= 3 and hits["memory"] + hits["disk"] == 5  # type: ignore[index]
    cache.check_integrity()
    cache.close()


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "flush"]), st.integers(0, 6)), max_size=30))
def test_cache_never_returns_a_wrong_value(ops: list[tuple[str, int]], tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = _cache(tmp_path_factory.mktemp("c"), 3 * len(tensor_to_bytes(_emb(0))))
    stored: set[int] = set()
    for op, k in ops:
        if op == "put":
            cache.put(f"k{k}", _emb(k))
            stored.add(k)
        elif op == "flush":
            cache.flush()
        else:
            got = cache.get(f"k{k}")
            assert got is None if k not in stored else (got is None or torch.equal(got, _emb(k)))
    cache.flush()
    assert all(torch.equal(cache.get(f"k{k}"), _emb(k)) for k in stored)  # disk holds everything
    cache.check_integrity()
    cache.close()


def test_redis_tier_round_trip_and_promotion(tmp_path: Path, redis_server: int) -> None:
    prefix = f"ec-{uuid.uuid4().hex}:"
    writer = _cache(tmp_path / "a", 1 << 20, RedisStore(port=redis_server, prefix=prefix))
    writer.put("k", _emb(7))
    writer.close()  # drains write-behind
    reader = EncoderCache([MemoryStore(1 << 20), LocalDirStore(tmp_path / "b"),
                           RedisStore(port=redis_server, prefix=prefix)])  # another server
    assert torch.equal(reader.get("k"), _emb(7))
    reader.flush()
    assert torch.equal(reader.get("k"), _emb(7))
    assert reader.stats()["hits"] == {"memory": 1, "disk": 0, "redis": 1}
    assert LocalDirStore(tmp_path / "b").get("enc:k") is not None  # promoted to disk too
    reader.close()


def test_unreachable_redis_tier_is_a_miss(tmp_path: Path) -> None:
    cache = EncoderCache([MemoryStore(1 << 20), RedisStore(port=1, timeout_s=0.1)])
    t0 = time.perf_counter()
    assert cache.get("k") is None
    cache.put("k", _emb(1))
    cache.flush()
    assert torch.equal(cache.get("k"), _emb(1))  # memory still serves
    assert time.perf_counter() - t0 < 1.0
    cache.close()
