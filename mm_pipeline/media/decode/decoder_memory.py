"""What one video decoder holds at its peak, from the stream's parameters -- the decode budget's
estimate for it (``frame_decode_bytes``), known before any frame is decoded -- and the codec
threads it runs (``codec_threads``), each of which holds pictures of its own.

    bytes    = pictures x (a frame in the stream's own pixel format + its side tables, 1-2 B/px)
    pictures = the stream's reference and reorder pictures (its DPB, below)
               + the picture being decoded + the last output one decode_range keeps
               + one picture's worth of the decoder's own buffers (packets, scratch)
               + 2 per extra codec thread (frame threads each hold pictures of their own)

A decoder keeps every picture a later one may predict from, and those waiting to be shown in
order. How many, the stream says: H.264 its SPS's ``max_num_ref_frames`` plus the reorder delay
FFmpeg settled on (``has_b_frames``), HEVC its SPS's ``sps_max_dec_pic_buffering`` (which holds
both); other codecs have a fixed number of reference slots (``_CODEC_REFS``); each bounded by the
16 the standards and FFmpeg allow; the largest over every SPS the header carries, since a slice may
name any of them. (An SPS sent later inside the packets is not read: one that raises the count
over the header's is bounded only by the pixel limit.) A picture is its planes at the stream's pixel format (a 10-bit
4:4:4 frame is 4x an 8-bit 4:2:0 one) and its tables (motion vectors, reference indices,
macroblock types: ~1 B/px; HEVC's decoder, counted at 2 B/px, holds more). Before, the estimate
was 4 frames of 8-bit 4:2:0 whatever the stream: a 16 KB H.264 High 4:4:4 10-bit file of 16
references at 2048² held +447 MiB against 24 MiB reserved.

Measured (peak RSS a fresh process adds decoding 24 frames, in pictures of planes + tables; the
estimate in brackets): x264 at 1024², 4:2:0: ref=1 2.6 (4), ref=16 15.1 (19), preset medium (4
refs, B-pyramid) 6.1 (9), veryslow ref=16 12.6 (21); 4:4:4 10-bit ref=1 2.7 (4), ref=16 16.6
(19); at 768², 4:4:4 10-bit ref=1 3.1-3.5 (4); x265 at 1024²: 5.1-6.8 (8-10); VP9 3.7 (11);
MPEG-4 part 2 3.6 (6). Four codec threads added 0.5-1.9 pictures per extra thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

import av

if TYPE_CHECKING:  # video imports this module (VideoInfo carries the stream's dpb and picture bytes)
    from mm_pipeline.media.decode.video import VideoInfo

# SPSs read from one stream's parameter sets: H.264 allows 32 ids, HEVC 16 (a hostile record may
# declare thousands; each parse is cheap but not free)
_MAX_SPS = 32
MAX_DPB = 16  # reference/reorder pictures a stream may declare (H.264, HEVC: FFmpeg refuses more)
# per-picture tables beside the planes (motion vectors and the like), bytes per pixel; FFmpeg's
# HEVC decoder keeps a motion field of 4x4 blocks per picture and frame-sized tables of its own
_SIDE_BYTES_PER_PIXEL = {"hevc": 2}
_SIDE_BYTES_DEFAULT = 1
_UNKNOWN_BYTES_PER_PIXEL = 8  # pixel format not known from the probe: the widest common one (RGBA64)
# reference slots of codecs whose count is fixed (intra-only codecs -- PNG, MJPEG, ProRes... --
# keep none); a codec not named here is counted at MAX_DPB
_CODEC_REFS = {
    "mpeg1video": 2, "mpeg2video": 2, "mpeg4": 2, "msmpeg4v2": 2, "msmpeg4v3": 2, "h263": 2, "h263p": 2,
    "flv1": 2, "wmv1": 2, "wmv2": 2, "wmv3": 2, "vc1": 2, "theora": 2, "vp8": 3, "vp9": 8, "av1": 8,
    "libdav1d": 8, "png": 0, "apng": 0, "mjpeg": 0, "prores": 0, "dnxhd": 0, "ffv1": 0, "rawvideo": 0,
    "qtrle": 0, "gif": 0, "bmp": 0, "tiff": 0, "jpeg2000": 0, "huffyuv": 0, "ffvhuff": 0, "utvideo": 0,
}


def frame_bytes(pix_fmt: str | None, width: int, height: int) -> int:
    """Bytes of one decoded frame of ``width`` x ``height`` in ``pix_fmt``, every plane (FFmpeg's
    padded bits per pixel: a 10-bit sample takes 16); the widest common format when unknown."""
    if pix_fmt:
        try:
            bits = av.VideoFormat(pix_fmt).padded_bits_per_pixel
        except (ValueError, av.FFmpegError):
            bits = 0
        if bits > 0:
            return -(-width * height * bits // 8)
    return width * height * _UNKNOWN_BYTES_PER_PIXEL


def dpb_pictures(codec: str, extradata: bytes | None, reorder: int) -> int:
    """Pictures a decoder of ``codec`` keeps for reference and reordering, from its parameter
    sets (``extradata``) and ``reorder`` (FFmpeg's ``has_b_frames`` after the stream probe)."""
    reorder = min(max(reorder, 0), MAX_DPB)
    if codec == "h264":
        refs = h264_max_refs(extradata)
        return min(MAX_DPB if refs is None else refs, MAX_DPB) + reorder
    if codec == "hevc":
        pictures = hevc_max_dec_pictures(extradata)
        return min(MAX_DPB if pictures is None else pictures, MAX_DPB)
    return min(_CODEC_REFS.get(codec, MAX_DPB) + reorder, 2 * MAX_DPB)


def decoder_pictures(dpb: int, threads: int) -> int:
    """Pictures held by one decoder of ``dpb`` reference/reorder pictures with ``threads`` codec
    threads (module doc)."""
    return dpb + 3 + 2 * (max(threads, 1) - 1)


def picture_bytes(codec: str, frame: int, pixels: int) -> int:
    """One picture a ``codec`` decoder holds: ``frame`` bytes of planes and its side tables."""
    return frame + _SIDE_BYTES_PER_PIXEL.get(codec, _SIDE_BYTES_DEFAULT) * pixels


def frame_decode_bytes(info: VideoInfo, threads: int = 1) -> int:
    """Peak bytes a decoder of ``info``'s stream holds (``threads`` as ``decode_range`` takes it)
    -- the in-flight budget's estimate for one video decoder: its reference and reorder pictures,
    the one being built, the last output one, two more per extra codec thread, each of the
    stream's own pixel format (module doc)."""
    pixels = info.height * info.width
    picture = info.picture_bytes or picture_bytes("", frame_bytes(None, info.width, info.height), pixels)
    return decoder_pictures(info.dpb, codec_threads(threads, pixels)) * picture


# ---- codec threads ------------------------------------------------------------------------------
# Codec threads only up to 4K UHD frames: each frame thread holds frames of its own, and a hostile
# 8192² stream must not multiply its decoder's memory by the thread count.
THREADED_MAX_PIXELS = 3840 * 2160
_MAX_AUTO_THREADS = 16  # FFmpeg's own cap on automatic thread counts


def codec_threads(threads: int, pixels: int) -> int:
    """The codec threads one decoder of ``pixels``-sized frames uses for a ``threads`` setting (0:
    FFmpeg's automatic count, CPUs + 1; 1: none); 1 above ``THREADED_MAX_PIXELS``."""
    if threads < 0:
        raise ValueError(f"codec threads must be >= 0, got {threads}")
    if pixels > THREADED_MAX_PIXELS:
        return 1
    if threads == 0:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return min(cpus + 1, _MAX_AUTO_THREADS)
    return threads


def shared_codec_threads(workers: int) -> int:
    """Codec threads per decoder when ``workers`` decoders run at once (the runtime's setting for
    ``decoder_threads`` 0): the CPUs shared out among them, at least 1 (= none). A streamed video
    keeps every decode worker busy with a chunk, so on a host with no more CPUs than workers the
    parallelism is already there and frame threads only add work: each chunk's decoder starts,
    flushes and runs ahead of its last frame with them (30 one-group chunks of a 60 s 720p clip,
    two workers: 1.48 s of CPU with FFmpeg's automatic count vs 0.94 s with none; README
    "pipeline")."""
    if workers < 1:
        raise ValueError(f"decode workers must be >= 1, got {workers}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // workers)


# ---- parameter sets -----------------------------------------------------------------------------
def h264_max_refs(extradata: bytes | None) -> int | None:
    """The largest ``max_num_ref_frames`` of the SPSs in H.264 ``extradata`` (an ``avcC`` record,
    as MP4 and Matroska carry, or Annex B start codes): the decoder takes whichever a slice names,
    so a small first one must not hide a large second one; None when none parses."""
    return _largest(_h264_refs(sps) for sps in _sps_units(extradata, h264=True))


def _h264_refs(sps: bytes) -> int | None:
    try:
        r = _Bits(_unescape(sps[1:]))
        profile = r.u(8)
        r.u(16)  # constraint flags, level
        r.ue()  # seq_parameter_set_id
        if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
            chroma = r.ue()
            if chroma == 3:
                r.u(1)  # separate_colour_plane_flag
            r.ue(), r.ue()  # bit depths
            r.u(1)  # qpprime_y_zero_transform_bypass_flag
            if r.u(1):  # seq_scaling_matrix_present_flag
                for i in range(8 if chroma != 3 else 12):
                    if r.u(1):
                        _skip_scaling_list(r, 16 if i < 6 else 64)
        r.ue()  # log2_max_frame_num_minus4
        poc_type = r.ue()
        if poc_type == 0:
            r.ue()
        elif poc_type == 1:
            r.u(1), r.se(), r.se()
            for _ in range(min(r.ue(), 255)):
                r.se()
        return r.ue()
    except (IndexError, ValueError):
        return None


def hevc_max_dec_pictures(extradata: bytes | None) -> int | None:
    """The largest ``sps_max_dec_pic_buffering`` (of the highest sub-layer) of the SPSs in HEVC
    ``extradata`` (an ``hvcC`` record or Annex B); None when none parses."""
    return _largest(_hevc_pictures(sps) for sps in _sps_units(extradata, h264=False))


def _hevc_pictures(sps: bytes) -> int | None:
    try:
        r = _Bits(_unescape(sps[2:]))
        r.u(4)  # sps_video_parameter_set_id
        sub_layers = r.u(3)  # sps_max_sub_layers_minus1
        r.u(1)
        r.u(8), r.u(32), r.u(32), r.u(16), r.u(8)  # general profile, compatibility, constraints, level
        present = [(r.u(1), r.u(1)) for _ in range(sub_layers)]
        if sub_layers:
            r.u(2 * (8 - sub_layers))
        for profile, level in present:
            r.u(88 * profile + 8 * level)  # sub-layer profile and level, where present
        r.ue()  # sps_seq_parameter_set_id
        if r.ue() == 3:  # chroma_format_idc
            r.u(1)
        r.ue(), r.ue()  # picture size
        if r.u(1):  # conformance window
            r.ue(), r.ue(), r.ue(), r.ue()
        r.ue(), r.ue(), r.ue()  # bit depths, log2_max_pic_order_cnt_lsb_minus4
        pictures = 0
        for _ in range(0 if r.u(1) else sub_layers, sub_layers + 1):
            pictures = r.ue() + 1  # sps_max_dec_pic_buffering_minus1
            r.ue(), r.ue()  # num_reorder_pics, max_latency_increase
        return pictures
    except (IndexError, ValueError):
        return None


def _largest(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _sps_units(extradata: bytes | None, h264: bool) -> list[bytes]:
    """Every SPS NAL unit of ``extradata`` (``avcC``/``hvcC`` or Annex B), at most ``_MAX_SPS``."""
    if not extradata or len(extradata) < 8:
        return []
    found: list[bytes] = []
    if extradata[0] == 1:  # a decoder configuration record
        if h264:
            pos = 6
            for _ in range(extradata[5] & 0x1F):
                size = int.from_bytes(extradata[pos:pos + 2], "big")
                if size:
                    found.append(extradata[pos + 2:pos + 2 + size])
                pos += 2 + size
            return [sps for sps in found if sps][:_MAX_SPS]
        if len(extradata) < 23:
            return []
        pos = 23
        for _ in range(extradata[22]):
            if pos + 3 > len(extradata):  # a record cut short: what it held so far
                break
            kind, count = extradata[pos] & 0x3F, int.from_bytes(extradata[pos + 1:pos + 3], "big")
            pos += 3
            for _ in range(count):
                size = int.from_bytes(extradata[pos:pos + 2], "big")
                if kind == 33 and size:
                    found.append(extradata[pos + 2:pos + 2 + size])
                pos += 2 + size
            if pos >= len(extradata) or len(found) >= _MAX_SPS:
                break
        return [sps for sps in found if sps][:_MAX_SPS]
    for nal in extradata.split(b"\x00\x00\x01")[1:]:  # Annex B
        if nal and ((nal[0] & 0x1F) == 7 if h264 else (nal[0] >> 1) & 0x3F == 33):
            found.append(nal)
    return found[:_MAX_SPS]


def _unescape(nal: bytes) -> bytes:
    """The RBSP: emulation prevention bytes (00 00 03) removed."""
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def _skip_scaling_list(r: _Bits, size: int) -> None:
    last = next_ = 8
    for _ in range(size):
        if next_:
            next_ = (last + r.se() + 256) % 256
        last = next_ or last


class _Bits:
    """MSB-first bit reader with Exp-Golomb codes; IndexError past the end."""

    def __init__(self, data: bytes) -> None:
        self.value, self.left = int.from_bytes(data, "big"), 8 * len(data)

    def u(self, n: int) -> int:
        if n > self.left:
            raise IndexError("parameter set ends early")
        self.left -= n
        return (self.value >> self.left) & ((1 << n) - 1)

    def ue(self) -> int:
        zeros = 0
        while not self.u(1):
            zeros += 1
            if zeros > 31:
                raise ValueError("Exp-Golomb code too long")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k % 2 else -(k // 2)
