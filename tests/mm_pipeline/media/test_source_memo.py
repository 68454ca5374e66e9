"""The source memo: a repeated data URL or unchanged local file is known by its text / stat, so ingest
neither decodes, reads nor hashes it (a DeferredMediaItem); a changed file is hashed again, a file
changed after its hit is refused when read, a freshly written file is never trusted."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import blake3
import pytest
from tests.support.media_samples import image_bytes, video_bytes

from mm_pipeline.errors import InvalidMediaError, UnsupportedMediaType
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
from mm_pipeline.media.source_memo import DataUrlIds, SourceMemo, data_url_id
from mm_pipeline.media.types import DeferredMediaItem, MediaKind, MediaSource

PNG, OTHER_PNG = image_bytes("PNG"), image_bytes("PNG", size=(48, 64))


def durl(data: bytes) -> str:
    return "data:;base64," + base64.b64encode(data).decode()


def test_a_repeated_data_url_is_not_decoded_or_hashed_again(monkeypatch) -> None:
    ing = MediaIngestor(IngestConfig())
    first = ing.ingest_local(MediaSource(url=durl(PNG)))
    decodes = []
    real = MediaIngestor._parse_data_url
    monkeypatch.setattr(MediaIngestor, "_parse_data_url", lambda self, url: decodes.append(1) or real(self, url))
    again = ing.ingest_local(MediaSource(url=durl(PNG)))
    assert isinstance(again, DeferredMediaItem) and not again.loaded and decodes == []
    assert (again.kind, again.format, again.content_key) == (first.kind, first.format, content_key(PNG))
    assert ing.counts == {"content_hashes.image": 1, "source_memo_hits.image": 1}
    assert again.data == PNG and again.data == PNG and decodes == [1]  # decoded on first use, once
    # other text, other entry; a declared kind the content cannot serve is still refused
    assert ing.ingest_local(MediaSource(url=durl(OTHER_PNG))).content_key == content_key(OTHER_PNG)
    with pytest.raises(UnsupportedMediaType, match="not usable as audio"):
        ing.ingest_local(MediaSource(url=durl(PNG), kind=MediaKind.AUDIO))
    assert data_url_id("data:;base64,\u00e9") is None  # never decodes: no memo entry either
    long = durl(bytes(range(256)) * 1000)  # hashed in pieces: the id is blake3 of the whole text
    assert data_url_id(long) == ("data", blake3.blake3(long.encode("ascii")).digest())


def test_data_url_ids_answer_a_kept_text_by_comparison_and_only_an_equal_one(monkeypatch) -> None:
    from mm_pipeline.media import source_memo

    hashed = []
    real = source_memo.data_url_id
    monkeypatch.setattr(source_memo, "data_url_id", lambda url, scheme="data": hashed.append(url) or real(url, scheme))
    ids = DataUrlIds(max_chars=3 * len(durl(PNG)))
    a, b = durl(PNG), durl(OTHER_PNG)
    assert ids(a) == real(a) and len(hashed) == 1
    copy = "".join([a[:5], a[5:]])  # equal text, another object (a new JSON parse of the same body)
    assert copy is not a and ids(copy) == real(a) and ids(a) == real(a) and len(hashed) == 1
    # the same length and ends but another middle: compared unequal, hashed, not given a's id
    middle = a[:ids.ENDS + 1] + ("A" if a[ids.ENDS + 1] != "A" else "B") + a[ids.ENDS + 2:]
    assert len(middle) == len(a) and ids(middle) == real(middle) != real(a) and len(hashed) == 2
    assert ids(a) == real(a) and len(hashed) == 3  # the entry was replaced by the other text: hashed again
    # bounded: a third text evicts the oldest; a text over the bound is hashed and not kept
    ids(b)
    assert ids.chars <= ids.max_chars
    tiny = DataUrlIds(max_chars=10)
    assert tiny(a) == real(a) and tiny.chars == 0
    assert ids("data:;base64,\u00e9") is None and tiny("data:;base64,\u00e9") is None  # not ASCII: never decodes
    # a bare base64 payload's id is kept apart: the same text under the other scheme is hashed anew
    n = len(hashed)
    assert ids(a, "base64") == ("base64", real(a)[1]) != real(a) and len(hashed) == n + 1
    assert ids(a, "base64") == ("base64", real(a)[1]) and len(hashed) == n + 1


def _trusting(ing: MediaIngestor) -> MediaIngestor:
    ing.source_memo = SourceMemo(racy_s=0.0)  # files written by this test are milliseconds old
    return ing


def test_an_unchanged_file_is_not_read_again_a_changed_one_is(tmp_path: Path) -> None:
    clip = tmp_path / "clip.mp4"
    mp4 = video_bytes(n_frames=10)
    clip.write_bytes(mp4)
    ing = _trusting(MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),))))
    assert ing.ingest_local(MediaSource(path=str(clip))).content_key == content_key(mp4)
    hit = ing.ingest_local(MediaSource(url=clip.as_uri()))  # the same file by URL: one real path
    assert isinstance(hit, DeferredMediaItem) and not hit.loaded and hit.kind is MediaKind.VIDEO
    assert hit.data == mp4 and ing.counts["content_hashes.video"] == 1
    # rewritten in place with the same size and the old mtime: ctime moved, so it is hashed again
    st = clip.stat()
    changed = bytearray(mp4)
    changed[len(changed) // 2] ^= 0xFF  # a byte of the frames: the container still opens
    clip.write_bytes(bytes(changed))
    os.utime(clip, ns=(st.st_atime_ns, st.st_mtime_ns))
    fresh = ing.ingest_local(MediaSource(path=str(clip)))
    assert not isinstance(fresh, DeferredMediaItem) and fresh.content_key == content_key(bytes(changed))
    assert ing.counts["content_hashes.video"] == 2


def test_a_file_changed_after_its_hit_is_refused_when_read(tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(PNG)
    ing = _trusting(MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),))))
    ing.ingest_local(MediaSource(path=str(img)))
    hit = ing.ingest_local(MediaSource(path=str(img)))
    assert isinstance(hit, DeferredMediaItem) and not hit.loaded
    img.write_bytes(OTHER_PNG)  # between the plan (cache keys of PNG) and the decode
    with pytest.raises(InvalidMediaError, match="changed while it was being served"):
        hit.data


def test_a_file_changed_within_the_racy_window_is_never_trusted(tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(PNG)
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),)))  # default racy_s
    for _ in range(2):
        assert not isinstance(ing.ingest_local(MediaSource(path=str(img))), DeferredMediaItem)
    assert ing.counts["content_hashes.image"] == 2 and len(ing.source_memo) == 0
    old = img.stat().st_ctime - 10.0  # as if the file had been written 10 s before its read
    memo = SourceMemo()
    assert memo.put(("file", str(img), 0, 0, len(PNG), 0, int(old * 1e9)), "k", read_at=old + 10.0)
    assert not memo.put(("file", str(img), 0, 0, len(PNG), 0, int(old * 1e9)), "k", read_at=old + 1.0)


def test_the_memo_is_bounded() -> None:
    memo = SourceMemo(max_entries=2)
    for i in range(3):
        memo.put(("data", bytes([i])), f"k{i}")
    assert len(memo) == 2 and memo.get(("data", b"\x00")) is None and memo.get(("data", b"\x02")) == "k2"
    with pytest.raises(ValueError):
        SourceMemo(racy_s=-1)


@pytest.mark.parametrize("swap", ["symlink flipped", "file replaced"])
def test_a_swap_between_the_stat_and_the_read_leaves_no_wrong_memo(tmp_path: Path, monkeypatch, swap: str) -> None:
    """The memo id comes from a stat, the content from a read just after. A deploy flipping a
    ``latest -> vN`` symlink, or renaming a new file over the old one, in between must never leave
    one file's content key under another file's id: before, v1.wav's id got v2's key (served v2's
    cached rows, or a 400 "changed while it was being served" forever)."""
    v1, v2, link = tmp_path / "v1.png", tmp_path / "v2.png", tmp_path / "latest.png"
    v1.write_bytes(PNG)
    v2.write_bytes(OTHER_PNG)
    link.symlink_to(v1)
    ing = _trusting(MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),))))
    read = MediaIngestor._read_file
    target = link if swap == "symlink flipped" else v1

    def racing(self, real, raw):
        if not racing.done:
            racing.done = True
            new = tmp_path / "new"
            if swap == "symlink flipped":
                new.symlink_to(v2)
            else:
                new.write_bytes(OTHER_PNG)
            os.replace(new, target)
        return read(self, real, raw)
    racing.done = False
    monkeypatch.setattr(MediaIngestor, "_read_file", racing)
    first = ing.ingest_local(MediaSource(path=str(target)))
    if swap == "symlink flipped":  # the file that was checked is the one read
        assert first.content_key == content_key(PNG)
    for path, data in ((v1, v1.read_bytes()), (target, target.read_bytes())):
        again = ing.ingest_local(MediaSource(path=str(path)))
        assert again.content_key == content_key(data) and again.data == data


def test_memo_entries_are_kept_per_cache_salt(tmp_path: Path, monkeypatch) -> None:
    """A hit skips hashing and the sniff, so it is shared only within one cache_salt: a tenant
    cannot time whether another already sent the same data URL, file or bytes."""
    import av

    mp4 = video_bytes(n_frames=10)
    (tmp_path / "clip.bin").write_bytes(mp4)
    ing = MediaIngestor(IngestConfig(allowed_local_dirs=(str(tmp_path),)))
    ing.source_memo = SourceMemo(racy_s=0.0)  # files written by this test are milliseconds old
    sources = [MediaSource(url=durl(mp4)), MediaSource(path=str(tmp_path / "clip.bin")), MediaSource(data=mp4)]
    for source in sources:
        ing.ingest_local(source, salt="tenant-a")
    probes = ing.counts["sniff_probes.video"]
    assert probes == 1 and "source_memo_hits.video" not in ing.counts
    opens = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: opens.append(1) or real_open(*a, **k))
    for salt in ("tenant-b", None):  # another salt, and no salt, each start from nothing
        items = [ing.ingest_local(source, salt=salt) for source in sources]
        assert not any(isinstance(i, DeferredMediaItem) for i in items)
        assert {i.content_key for i in items} == {content_key(mp4)}  # the content key itself is not salted
    assert len(opens) == 2 and ing.counts["sniff_probes.video"] == probes + 2
    assert "source_memo_hits.video" not in ing.counts
    again = [ing.ingest_local(source, salt="tenant-a") for source in sources[:2]]
    assert all(isinstance(i, DeferredMediaItem) for i in again) and len(opens) == 2
    assert ing.counts["source_memo_hits.video"] == 2
    assert ing.sniff_memo.get(content_key(mp4), "tenant-c") is None
    # the kept data-URL texts too: another salt's text is hashed, not recognised by comparison
    hashed = []
    monkeypatch.setattr("mm_pipeline.media.source_memo.data_url_id",
                        lambda url, scheme="data": hashed.append(scheme) or ("data", b"x"))
    ing.data_url_ids(durl(mp4), salt="tenant-a")
    assert hashed == []
    ing.data_url_ids(durl(mp4), salt="tenant-z")
    assert hashed == ["data"]
    assert ing.sniff_memo.get(content_key(mp4), "tenant-a") is not None
