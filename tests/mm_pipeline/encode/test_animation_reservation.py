"""What a GIF/WebP animation's chunk reserves in the decode budget covers what decoding it holds,
measured as the peak RSS of a fresh process (PIL's canvases are outside tensors and numpy).

What is proven: a GIF whose frames grow the canvas past its header's logical screen (16x16 here,
a frame at 1499,1499: PIL composites the later frames on a 1500x1500 canvas, as browsers show it)
is reserved for on the grown canvas -- before, on the 16x16 header (2 KB for ~29 MB of
compositing) -- and the bytes per canvas pixel cover PIL's compositing of GIF and WebP frames
(before: 8, where a GIF frame holds 13 and a WebP one 24).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from PIL import Image

from samples.synthetic.hostile_media import pixel_frames_gif

ROOT = Path(__file__).resolve().parents[3]

_PEAK_RSS = textwrap.dedent("""
    import gc, json, sys
    sys.path.insert(0, sys.argv[1])
    from encoders.image_processing import ImageProcessingConfig
    from llm_core.storage import MemoryStore
    from mm_pipeline.encode.batcher import EncoderBatcher
    from mm_pipeline.encode.encoder_cache import EncoderCache
    from mm_pipeline.encode.plan import PlannerConfig
    from mm_pipeline.encode.preprocess import Preprocessor
    from mm_pipeline.encode.unit_producer import UnitProducer
    from mm_pipeline.media.types import MediaItem, MediaKind

    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

    out = []
    for path, fmt in json.loads(sys.argv[2]):
        # frames resized small (256²), so the reservation is PIL's canvas and little else
        pre = Preprocessor(ImageProcessingConfig(video_max_pixels=1 << 16))
        producer = UnitProducer(pre, None, EncoderBatcher(None, None), EncoderCache([MemoryStore(1 << 20)]),
                                PlannerConfig(), lambda *a, **k: None)
        reserved = []
        real = producer.budget.reserve
        producer.budget.reserve = lambda n, *a, **k: (reserved.append(int(n)), real(n, *a, **k))[1]
        item = MediaItem(MediaKind.VIDEO, fmt, open(path, "rb").read())
        info, sampling, size = producer.probe_video(item)
        tp = producer.pre.image_config.temporal_patch_size
        groups = list(range(sampling.num_frames // tp))
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # the peak RSS from here
        base = status("VmRSS")
        producer._video_chunk(item, info, sampling.indices, groups, size, tp)  # as production runs it
        out.append({"name": path, "held": status("VmHWM") - base, "reserved": reserved[-1]})
    print(json.dumps(out))
""")
_RSS_SLACK = 2 << 20  # interpreter and PIL objects, page rounding (test_decode_peak_rss.py)


def test_an_animation_chunk_reservation_covers_its_canvas(tmp_path) -> None:
    grown = tmp_path / "grown.gif"
    grown.write_bytes(pixel_frames_gif(3, 1500, screen=16))  # 16x16 header; frame 1 grows it to 1500²
    with Image.open(grown) as img:
        assert img.size == (16, 16)
    webp = tmp_path / "anim.webp"
    frames = [Image.new("RGB", (1000, 1000), (40 * k, 0, 0)) for k in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    webp.write_bytes(buf.getvalue())
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # each peak its own (test_decode_peak_rss.py)
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(ROOT),
                          json.dumps([(str(grown), "gif"), (str(webp), "webp")])],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, canvas in zip(json.loads(run.stdout.strip().splitlines()[-1]), (1500 * 1500, 1000 * 1000)):
        name = Path(case["name"]).name
        assert case["held"] <= case["reserved"] + _RSS_SLACK, (
            f"{name}: held {case['held'] / canvas:.1f} B per canvas pixel, reserved {case['reserved'] / canvas:.1f}")
        assert case["reserved"] <= 2 * case["held"] + _RSS_SLACK, (
            f"{name}: held {case['held'] / canvas:.1f} B per canvas pixel, reserved {case['reserved'] / canvas:.1f}")
