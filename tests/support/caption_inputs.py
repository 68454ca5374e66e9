"""Caption job inputs for the single-process and the Ray caption tests: the committed sample media
plus broken files that must become error rows."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import SAMPLE_MEDIA as MEDIA


def folder_with_broken_files(root: Path) -> dict[str, str | None]:
    """Good samples plus broken ones; returns name -> expected modality (None: must fail)."""
    import shutil

    expect: dict[str, str | None] = {}
    for name in ("image_000001.png", "video_000000.mp4", "audio_000003.wav", "audio_000001.flac"):
        shutil.copy(MEDIA / name, root / name)
        expect[name] = name.split("_")[0]
    sub = root / "nested" / "deeper"
    sub.mkdir(parents=True)
    shutil.copy(MEDIA / "image_000002.jpg", sub / "image_000002.jpg")
    expect["nested/deeper/image_000002.jpg"] = "image"
    (root / "truncated.png").write_bytes((MEDIA / "image_000001.png").read_bytes()[:200])
    (root / "noise.jpg").write_bytes(bytes(range(256)) * 8)
    (root / "empty.mp4").write_bytes(b"")
    (root / "text.webm").write_bytes(b"this is not a video at all\n" * 20)
    for name in ("truncated.png", "noise.jpg", "empty.mp4", "text.webm"):
        expect[name] = None
    return expect
