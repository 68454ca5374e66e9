"""Which demuxed packets an early decoder (``early.EarlyVideoDecode``) decodes, told before decoding.

Two questions, one class each:

* ``PresentationRanks``: where a packet's frame will stand in presentation order, from the pts
  demuxed so far -- so the decoder knows which frames the sampling keeps before it decodes them.
* ``KeyframeSkip``: whether a packet must be decoded at all. A sampled frame needs the frames from
  the keyframe before it, nothing earlier; the sampling keeps a frame every ~1/fps seconds and a
  keyframe comes every GOP, so the tail of each GOP after its last kept frame is decoded for
  nothing (a 60 s 720p clip, keyframe every 2 s, 60 kept frames: 1,266 of 1,800 frames are needed).
  Production's own decode (``decode_range``) already starts each chunk at the keyframe before it
  (a seek); the early decoder cannot seek in bytes still arriving, so it holds packets back
  instead: held packets are decoded (as references, never kept) when a kept frame of the same
  keyframe span follows, and dropped undecoded at the next keyframe.

    decode order   K  p  p  [p] p  p  K  p  p  p  p  p  K  p  [p] ...     [p]: a kept frame
    decoded        K  p  p  [p] -  -  -  -  -  -  -  -  K  p  [p]
                                   held, then dropped at K: no kept frame in that span

That is sound only while a frame's references lie between its keyframe and itself. A stream
whose pts arrive out of order (B-frames) may show a frame right after a keyframe that refers to
the span before it (an open GOP), so the skip stops at the first pts out of order: before it
dropped anything, the held packets are decoded and decoding goes on as before (front to back);
after, the early decoder ends there -- its kept frames are sound (every span it restarted at had
its frames in order), and production decodes the rest as it does every frame the early decoder
did not keep. A wrong guess costs time, never correctness.
"""

from __future__ import annotations

import array
import bisect

import av


class PresentationRanks:
    """Where each frame stands in presentation order, told from the packets demuxed so far: the
    rank of a pts is how many smaller pts were seen. For a decoded frame that is exact (a frame
    leaves the decoder after every frame shown before it was demuxed); for a packet about to be
    decoded it is exact whenever no frame shown earlier comes later in decode order -- what B-frame
    encoders write (x264's pyramid, MPEG-4 B-frames: tests). A wrong guess costs time, never
    correctness: a frame decoded for nothing, or a kept one dropped that production then decodes."""

    def __init__(self) -> None:
        # ascending (inserts land near the end); 8 bytes a packet, a third of FFmpeg's own index
        # per sample, and the decode deadline bounds the inserts' time (a hostile header)
        self._seen = array.array("q")

    def add(self, pts: int) -> int:
        """Record a demuxed packet's pts; its rank so far."""
        k = bisect.bisect_left(self._seen, pts)
        self._seen.insert(k, pts)
        return k

    def rank(self, pts: int) -> int:
        return bisect.bisect_left(self._seen, pts)


Batch = list[tuple[av.Packet, bool]]  # packets to decode now, in decode order, and whether a kept frame needs each


class KeyframeSkip:
    """The packets to decode, packet by packet (module doc). ``skipped``: packets dropped undecoded."""

    # held packets at most: past it they are decoded (a stream whose keyframes are minutes apart
    # would otherwise hold its compressed frames; the body's own size cap bounds them too)
    MAX_HELD = 1024

    def __init__(self) -> None:
        self._held: list[av.Packet] = []
        self._last_pts: int | None = None
        self._in_order = True
        self.skipped = 0

    def feed(self, packet: av.Packet, need: bool) -> Batch | None:
        """What to decode now that ``packet`` was demuxed (``need``: a kept frame is in it): the held
        packets and it when it is needed, [] when it is held, or None when its pts is out of order
        after packets were dropped: the early decoder stops there (module doc)."""
        if not self._in_order:
            return [(packet, need)]
        if packet.size == 0:  # the demuxer's end: drain the decoder (held packets feed no kept frame)
            return [(packet, need)]
        pts = packet.pts
        if pts is None or (self._last_pts is not None and pts < self._last_pts):
            if self.skipped:
                return None
            self._in_order = False  # frames out of order from the start: decode front to back
            return self._release([(packet, need)])
        self._last_pts = pts
        if packet.is_keyframe and self._held:
            self.skipped += len(self._held)  # nothing from here on refers to them
            self._held = []
        if need:
            return self._release([(packet, True)])
        self._held.append(packet)
        return self._release([]) if len(self._held) > self.MAX_HELD else []

    def _release(self, then: Batch) -> Batch:
        out = [(p, False) for p in self._held] + then
        self._held = []
        return out
