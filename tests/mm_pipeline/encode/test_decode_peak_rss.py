"""What a decode reserves in the decode budget covers what it then holds at its peak, measured
for PIL's memory and kernel temporaries (outside tensors and numpy: test_decode_peaks.py) as the
peak RSS of a fresh process.

Audio: the log-mel's STFT, then torch's ``abs`` of the spectrum through a complex64 temporary
(in one block for a whole clip: ~44 B/sample with the waveform). Images: the decode itself (PIL's
image, an oriented copy, a converted copy, ``tobytes``) up to 20 B/px, within its own bound, and
the whole ``image_input`` within what it reserves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from PIL import Image

from tests.mm_pipeline.encode.test_decode_peaks import _png, _rotated
from tests.support.media_samples import audio_bytes

ROOT = Path(__file__).resolve().parents[3]


# ---- whole decodes, as a process's peak RSS -------------------------------------------------------
_PEAK_RSS = textwrap.dedent("""
    import gc, io, json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    from PIL import Image
    from encoders.config import AudioConfig
    from encoders.image_processing import ImageProcessingConfig
    from llm_core.storage import MemoryStore
    from mm_pipeline.encode.batcher import EncoderBatcher
    from mm_pipeline.encode.encoder_cache import EncoderCache
    from mm_pipeline.encode.plan import PlannerConfig
    from mm_pipeline.encode.preprocess import Preprocessor
    from mm_pipeline.encode.unit_producer import UnitProducer
    from mm_pipeline.media.decode.image import probe_image
    from mm_pipeline.media.types import MediaItem, MediaKind
    from mm_pipeline.media.worker_pool import WorkerPool

    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

    def peak_of(fn):
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # the peak RSS from here
        base = status("VmRSS")
        result = fn()
        return status("VmHWM") - base, result

    pool = WorkerPool(1, 1)
    out = []
    for path, kind, fmt, max_pixels in json.loads(sys.argv[2]):
        pre = Preprocessor(ImageProcessingConfig(max_pixels=max_pixels), AudioConfig())
        producer = UnitProducer(pre, pool, EncoderBatcher(None, None), EncoderCache([MemoryStore(1 << 20)]),
                                PlannerConfig(), lambda *a, **k: None)
        reserved = []
        real = producer.budget.reserve
        producer.budget.reserve = lambda n, *a, **k: (reserved.append(int(n)), real(n, *a, **k))[1]
        item = MediaItem(MediaKind.IMAGE if kind == "image" else MediaKind.AUDIO, fmt, open(path, "rb").read())
        case = {"name": path}
        if kind == "audio":
            producer.audio_inputs(item)  # warm: the ops' first-call costs are not the item's
            case["whole"], _ = peak_of(lambda: producer.audio_inputs(item))
        else:
            buf = io.BytesIO()
            Image.new("RGB", (320, 200), (9, 9, 9)).save(buf, "PNG")
            producer.image_input(MediaItem(MediaKind.IMAGE, "png", buf.getvalue()))  # warm
            size = pre.image_size(*probe_image(item))
            # the decode alone, as image_input runs it, then the whole of image_input
            case["decode"], image = peak_of(lambda: producer.decoder.decode_image(item, producer.config.limits,
                                                                                  target=size))
            del image
            try:  # the decode's own bound (the reservation is the larger of it and the preprocess's)
                from mm_pipeline.media.decode.image import decode_image_peak
                case["bound"] = decode_image_peak(*probe_image(item), size)[0]
            except ImportError:
                case["bound"] = None
            case["whole"], _ = peak_of(lambda: producer.image_input(item))
        case["reserved"] = reserved[-1]
        out.append(case)
    pool.shutdown()
    print(json.dumps(out))
""")
# What a process's RSS holds beyond the decode's data: interpreter and PyAV / PIL objects, page
# rounding (measured: under 1.5 MiB); a missing per-sample or per-pixel term is tens of MiB here
_RSS_SLACK = 2 << 20


def _peak_rss(cases: list[tuple[str, str, str, int]]) -> list[dict]:
    # glibc's fixed mmap threshold: every large block goes back to the system when freed, so each
    # measurement's RSS peak is its own (the dynamic one keeps freed blocks for the next one)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(ROOT), json.dumps(cases)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_audio_reservation_covers_the_peak_rss(tmp_path):
    """3 minutes of 24 kHz audio: what ``audio_inputs`` reserves against the peak RSS of running it
    (the STFT, then ``abs`` of the spectrum through a complex temporary: ~44 B/sample in one block)."""
    path = tmp_path / "three_minutes.wav"
    path.write_bytes(audio_bytes(rate=24000, seconds=180.0, channels=1))
    (case,) = _peak_rss([(str(path), "audio", "wav", 0)])
    samples = 180 * 24000
    assert case["whole"] <= case["reserved"] + _RSS_SLACK, (
        f"audio_inputs held {case['whole'] / samples:.2f} B/sample, reserved {case['reserved'] / samples:.2f}")


def test_image_reservation_covers_the_peak_rss(tmp_path):
    """PIL's image, its EXIF-oriented copy, a mode conversion and ``tobytes`` (its chunks and
    their join) are outside tensors and numpy: the peak RSS of ``decode_image`` alone against its
    bound, and of the whole ``image_input`` against what it reserves. Shrunk sources (over twice
    the target per side) decode in a fraction of the reservation a full-size preprocess needs."""
    w, h = 1800, 1200
    cases = [
        ("rgba_rotated.png", "png", {"mode": "RGBA", "exif": _rotated(8)}, 8388608),
        ("cmyk_rotated.jpg", "jpeg", {"mode": "CMYK", "format": "JPEG", "exif": _rotated(6)}, 8388608),
        ("palette_alpha.png", "png", {"mode": "P", "transparency": 0}, 8388608),
        ("rgb_shrunk.png", "png", {}, 200_000),
        ("rgba_shrunk.png", "png", {"mode": "RGBA", "exif": _rotated(6)}, 200_000),
    ]
    files = []
    for name, fmt, save, max_pixels in cases:
        (tmp_path / name).write_bytes(_png((w, h), **save))
        files.append((str(tmp_path / name), "image", fmt, max_pixels))
    gray16 = np.broadcast_to(np.linspace(0, 65535, w)[None], (h, w)).astype(np.uint16)
    Image.fromarray(gray16).save(tmp_path / "gray16.png")
    Image.fromarray((gray16.astype(np.int32) * 3), "I").save(tmp_path / "int32.tiff")
    Image.fromarray(gray16.astype(np.float32) / 65535).save(tmp_path / "float.tiff")
    files += [(str(tmp_path / "gray16.png"), "image", "png", 8388608),
              (str(tmp_path / "int32.tiff"), "image", "tiff", 8388608),
              (str(tmp_path / "float.tiff"), "image", "tiff", 8388608)]
    for case in _peak_rss(files):
        name, px = Path(case["name"]).name, w * h
        assert case["decode"] <= case["reserved"], (
            f"{name}: decode held {case['decode'] / px:.1f} B/px, reserved {case['reserved'] / px:.1f}")
        assert case["bound"] is None or case["decode"] <= case["bound"], (
            f"{name}: decode held {case['decode'] / px:.1f} B/px, its bound {case['bound'] / px:.1f}")
        assert case["whole"] <= case["reserved"] + _RSS_SLACK, (
            f"{name}: image_input held {case['whole'] / px:.1f} B/px, reserved {case['reserved'] / px:.1f}")
