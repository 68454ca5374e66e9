"""Base64 payloads in ingest: pybase64 first (SIMD, GIL released), else decoded a piece at a time
(no call holds the GIL for a whole payload of megabytes), with exactly the strict whole-text semantics, and bare payloads (``input_audio.data``,
``file.file_data``) as sources of their own (``MediaSource.base64``)."""

from __future__ import annotations

import base64
import binascii

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.support.media_samples import image_bytes

from mm_pipeline.errors import InvalidMediaError, MediaTooLarge
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.media.ingest import MediaIngestor
from mm_pipeline.media.ingest_config import IngestConfig, MediaLimits
from mm_pipeline.media.types import MediaSource

PNG = image_bytes("PNG")


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(alphabet="AQgw+/=*", max_size=40),
                      st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()),
                      # valid encodings glued together: padding in the middle, at piece bounds too
                      st.lists(st.binary(max_size=5).map(lambda b: base64.b64encode(b).decode()),
                               max_size=6).map("".join),
                      # excess padding after the data, over piece bounds ("AAAAAAAA=" is 6 bytes)
                      st.tuples(st.binary(max_size=12), st.integers(1, 14)).map(
                          lambda bn: base64.b64encode(bn[0]).decode() + "=" * bn[1])),
       piece=st.sampled_from([4, 8, 12]))
def test_base64_decoded_in_pieces_is_the_whole_strict_decode(text: str, piece: int) -> None:
    """Decoding a payload a piece at a time (so no call holds the GIL for a whole 100 MB payload)
    accepts exactly what one strict call over the whole text accepts, with the same bytes."""
    from mm_pipeline.media.ingest import _a2b_pieces

    try:
        whole = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        whole = None
    try:
        pieces = _a2b_pieces(text, piece)
    except (binascii.Error, ValueError):
        pieces = None
    assert pieces == whole


@settings(max_examples=400, deadline=None)
@example(text="\x85")  # a Unicode space alone: str.split() took it for whitespace, and b"" came back
@example(text="QQ==\xa0")
@given(text=st.one_of(st.text(alphabet="AQgw+/=*-_ \n", max_size=40),
                      st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()),
                      st.binary(max_size=30).map(lambda b: base64.urlsafe_b64encode(b).decode()),
                      st.lists(st.binary(max_size=5).map(lambda b: base64.b64encode(b).decode()),
                               max_size=6).map("".join),
                      st.tuples(st.binary(max_size=12), st.integers(1, 6)).map(
                          lambda bn: base64.b64encode(bn[0]).decode() + "=" * bn[1]),
                      st.binary(max_size=60).map(lambda b: base64.encodebytes(b).decode()),
                      st.text(max_size=12)))
def test_the_fast_decoder_accepts_a_subset_of_the_strict_decode_with_its_bytes(text: str) -> None:
    """pybase64's SIMD path (tried first) never accepts what the strict decode refuses nor gives
    other bytes; what it refuses (line breaks, excess padding) still decodes by the strict path."""
    import pybase64

    from mm_pipeline.media.ingest import _strict_base64

    try:
        strict = binascii.a2b_base64("".join(text.split()), strict_mode=True) if text.isascii() else None
    except (binascii.Error, ValueError):
        strict = None
    try:
        fast = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        fast = None
    if fast is not None:
        assert fast == strict
    try:
        got = _strict_base64(text)
    except InvalidMediaError:
        got = None
    assert got == strict


def test_bare_base64_payloads_decode_like_data_urls_with_ids_of_their_own() -> None:
    """``MediaSource.base64`` (an input_audio part's data, a file part's file_data): the same strict
    decoding, size check and memo as a data URL's payload, but never the memo entry of a data URL
    whose text is the same string (that text is no valid base64)."""
    ing = MediaIngestor(IngestConfig(limits=MediaLimits(max_bytes=len(PNG) + 64)))
    text = base64.b64encode(PNG).decode()
    first = ing.ingest_local(MediaSource(base64=text))
    assert first.data == PNG and first.content_key == content_key(PNG)
    again = ing.ingest_local(MediaSource(base64=text))  # memo: nothing decoded until asked
    assert ing.counts["source_memo_hits.image"] == 1 and again.data == PNG
    with pytest.raises(InvalidMediaError, match="^base64 payload is not valid base64"):  # no "data URL" to confuse
        ing.ingest_local(MediaSource(base64=text[:8] + "*" + text[8:]))
    with pytest.raises(MediaTooLarge):
        ing.ingest_local(MediaSource(base64=base64.b64encode(PNG + bytes(128)).decode()))
    url = "data:;base64," + text
    assert ing.ingest_local(MediaSource(url=url)).data == PNG
    with pytest.raises(InvalidMediaError, match="not valid base64"):  # the URL's memo entry is not its
        ing.ingest_local(MediaSource(base64=url))
    with pytest.raises(ValueError, match="exactly one"):
        MediaSource(base64=text, url=url)
