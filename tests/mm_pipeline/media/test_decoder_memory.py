"""What a video decoder holds (media.decode.decoder_memory): the decode budget's estimate for one
decoder comes from the stream's pixel format and the pictures its parameter sets keep.

What is proven: the SPS fields are read from the records MP4 carries (H.264 ``max_num_ref_frames``,
HEVC ``sps_max_dec_pic_buffering``) and bounded, unknown parameters count at the maximum; and on a
small H.264 High 4:4:4 10-bit stream of 16 references the estimate is within a small factor of
the peak RSS a decode of it really adds (a fresh process), where the old estimate (4 frames of 8-bit
4:2:0) was a twentieth of it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import pytest

from encoders.image_processing import ImageProcessingConfig
from llm_core.storage import MemoryStore
from mm_pipeline.encode.batcher import EncoderBatcher
from mm_pipeline.encode.decode_peaks import video_chunk_bytes
from mm_pipeline.encode.encoder_cache import EncoderCache
from mm_pipeline.encode.plan import PlannerConfig
from mm_pipeline.encode.preprocess import Preprocessor
from mm_pipeline.encode.unit_producer import UnitProducer
from mm_pipeline.media.decode.decoder_memory import (MAX_DPB, decoder_pictures, dpb_pictures, frame_bytes,
                                                     frame_decode_bytes, h264_max_refs, hevc_max_dec_pictures,
                                                     picture_bytes)
from mm_pipeline.media.decode.video import probe_video
from mm_pipeline.media.types import MediaItem, MediaKind

ROOT = Path(__file__).resolve().parents[3]


def encoded(codec: str, side: int, pix_fmt: str, params: str, fmt: str = "mp4", n: int = 24) -> bytes:
    """``n`` frames of side x side noise scrolling sideways (every frame predicted from earlier ones)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=10)
        stream.width = stream.height = side
        stream.pix_fmt = pix_fmt
        key = "x264-params" if codec == "libx264" else "x265-params"
        stream.codec_context.options = {"preset": "ultrafast", key: params}
        base = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
        for k in range(n):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 3 * k, axis=1), format="rgb24").reformat(format=pix_fmt)
            frame.pts = k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _extradata(data: bytes) -> tuple[str, bytes, int]:
    with av.open(io.BytesIO(data)) as container:
        cc = container.streams.video[0].codec_context
        return cc.name, cc.extradata, cc.reorder_depth


@pytest.mark.parametrize("refs", [1, 5, 16])
def test_h264_reference_count_is_read_from_the_sps(refs: int) -> None:
    name, extradata, reorder = _extradata(encoded("libx264", 64, "yuv444p10le", f"ref={refs}:bframes=0:keyint=24"))
    assert name == "h264" and h264_max_refs(extradata) == refs
    assert dpb_pictures(name, extradata, reorder) == refs + reorder
    # the same SPS as Annex B (MPEG-TS, raw streams) and with emulation prevention bytes kept apart
    record = extradata[8:8 + int.from_bytes(extradata[6:8], "big")]
    assert h264_max_refs(b"\x00\x00\x00\x01" + record) == refs


def test_every_sps_of_the_parameter_sets_counts_not_only_the_first() -> None:
    """A decoder takes whichever SPS a slice names: a record whose first SPS declares 1 reference
    and whose second declares 16 is counted at 16 (the first alone under-reserved ~5x)."""
    def sps_of(refs: int) -> bytes:
        extradata = _extradata(encoded("libx264", 64, "yuv420p", f"ref={refs}:bframes=0:keyint=24", n=4))[1]
        return extradata[8:8 + int.from_bytes(extradata[6:8], "big")]

    small, large = sps_of(1), sps_of(16)
    record = bytes([1, small[1], small[2], small[3], 0xFF, 0xE0 | 2])
    record += b"".join(len(sps).to_bytes(2, "big") + sps for sps in (small, large)) + b"\x00"
    assert h264_max_refs(record) == 16
    assert h264_max_refs(b"".join(b"\x00\x00\x00\x01" + sps for sps in (small, large))) == 16  # Annex B
    assert dpb_pictures("h264", record, 0) == 16
    # an hvcC record that declares more arrays than it holds: what it held, no IndexError
    _, hevc, _ = _extradata(encoded("libx265", 64, "yuv420p", "log-level=none:ref=3:bframes=0:keyint=24", n=4))
    cut = hevc[:22] + bytes([200]) + hevc[23:]
    assert hevc_max_dec_pictures(cut) == hevc_max_dec_pictures(hevc)


def test_hevc_picture_buffer_is_read_from_the_sps() -> None:
    name, extradata, reorder = _extradata(encoded("libx265", 64, "yuv420p", "log-level=none:ref=3:bframes=2:keyint=24"))
    pictures = hevc_max_dec_pictures(extradata)
    assert name == "hevc" and pictures is not None and 3 <= pictures <= MAX_DPB
    assert dpb_pictures(name, extradata, reorder) == pictures


def test_unknown_parameters_count_at_the_maximum() -> None:
    assert dpb_pictures("h264", None, 0) == dpb_pictures("h264", b"\x01\x64\x00\x1f\xff\xe0", 0) == MAX_DPB
    assert dpb_pictures("h264", None, 99) == 2 * MAX_DPB  # a reorder delay bounded as FFmpeg bounds it
    assert dpb_pictures("hevc", b"\x00" * 30, 0) == MAX_DPB
    assert dpb_pictures("some_new_codec", None, 0) == MAX_DPB
    assert dpb_pictures("png", None, 0) == 0 and dpb_pictures("vp9", None, 0) == 8
    assert frame_bytes("yuv444p10le", 64, 64) == 64 * 64 * 6 and frame_bytes("yuv420p", 64, 64) == 64 * 64 * 3 // 2
    assert frame_bytes(None, 64, 64) == frame_bytes("no_such_format", 64, 64) == 64 * 64 * 8
    assert decoder_pictures(16, 1) == 19 and decoder_pictures(16, 4) == 25
    assert picture_bytes("h264", 100, 10) == 110 and picture_bytes("hevc", 100, 10) == 120


_PEAK = textwrap.dedent("""
    import gc, json, sys
    sys.path.insert(0, sys.argv[1])
    from mm_pipeline.media.decode.video import decode_range, probe_video
    from mm_pipeline.media.types import MediaItem, MediaKind

    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

    item = MediaItem(MediaKind.VIDEO, "mp4", open(sys.argv[2], "rb").read())
    info = probe_video(item)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS from here
    base = status("VmRSS")
    decode_range(item, info, [info.total_frames - 1], size=(32, 32))  # every frame, from the keyframe
    print(json.dumps(status("VmHWM") - base))
""")


def test_the_reservation_follows_pixel_format_and_references(tmp_path) -> None:
    """768² H.264 High 4:4:4 10-bit, 16 references (~1.8 MB): its decoder keeps 16 references of
    6 B per pixel. What a chunk of it reserves for its decoder (``UnitProducer.chunk_bytes`` less
    the chunk's frames and rows: 19 pictures of 6 + 1 B/px, 75 MiB) is within a small factor of
    the peak RSS a decode of it adds in a fresh process (67-76 MiB measured across runs: the RSS
    also carries the codec library's pages and the allocator's slack, so the check allows the
    estimate 20 % under it); before, 4 frames of 8-bit 4:2:0 (3.4 MiB), a twentieth of it."""
    side = 768
    data = encoded("libx264", side, "yuv444p10le", "ref=16:bframes=0:keyint=24")
    path = tmp_path / "refs16.mp4"
    path.write_bytes(data)
    producer = UnitProducer(Preprocessor(ImageProcessingConfig()), None, EncoderBatcher(None, None),
                            EncoderCache([MemoryStore(1 << 20)]), PlannerConfig(decoder_threads=1),
                            lambda *a, **k: None)
    item = MediaItem(MediaKind.VIDEO, "mp4", data)
    info = probe_video(item)
    size = (32, 32)
    reserved = producer.chunk_bytes(item, info, 2, size) - video_chunk_bytes(2, size, producer.pre.image_config)
    run = subprocess.run([sys.executable, "-c", _PEAK, str(ROOT), str(path)], capture_output=True, text=True,
                         timeout=120, check=True)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert 0.8 * measured <= reserved <= 2 * measured, f"reserved {reserved / mib:.1f} MiB, measured {measured / mib:.1f} MiB"
    assert info.dpb == 16 and info.picture_bytes == side * side * 7
    assert reserved == frame_decode_bytes(info, 1) > 8 * 4 * side * side * 3 // 2  # the old estimate
