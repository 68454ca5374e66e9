"""Parsing and checking pre-tokenized audio codes (media/audio_codes.py): every accepted spelling
gives the same codes, everything else an error naming the place; the canonical bytes round-trip and
tell shapes apart; the model checks name channels, codebooks and the duration limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.errors import InvalidMediaError, InvalidMessageError, MediaTooLarge, Where
from mm_pipeline.media.audio_codes import AudioCodes, check_codes, code_segments, parse_codes
from mm_pipeline.media.content_hash import content_key
from mm_pipeline.prompt.messages import parse_messages

ROWS = [[1, 2, 3, 4, 5], [0, 0, 7, 7, 1], [3, 1, 4, 1, 5]]  # 3 channels x 5 frames
X = Where(("x",))  # where the codes are, as an error names it


def test_lists_tensors_and_arrays_give_the_same_codes():
    want = torch.tensor(ROWS, dtype=torch.int32).T
    for value in (ROWS, tuple(map(tuple, ROWS)), torch.tensor(ROWS), np.array(ROWS, dtype=np.int16),
                  parse_codes(ROWS, X)):
        got = parse_codes(value, X)
        assert got.codes.dtype == torch.int32 and torch.equal(got.codes, want)
        assert (got.frames, got.channels) == (5, 3)


@pytest.mark.parametrize("value,needle", [
    ([], "non-empty list"), ("123", "non-empty list"), (None, "non-empty list"),
    ([[]], "[0] must be a non-empty list"), ([5], "[0] must be a non-empty list"),
    ([[1, 2], [3]], "ragged: channel 0 has 2 frames, channel 1 has 1"),
    ([[1, 2.0]], "holds a float"), ([[1, True]], "holds a bool"), ([[1, "2"]], "holds a str"),
    ([[1, None]], "holds a NoneType"), ([[1, [2]]], "holds a list"), ([[2**31]], "32-bit"),
    ([[0]] * 65, "65 channels"), (torch.zeros(2, 3, 4, dtype=torch.int64), "2-D"),
    (torch.zeros(2, 0, dtype=torch.int64), "2-D"), (torch.zeros(2, 3), "integers"),
    (np.array([[2**40]]), "32-bit"), (torch.zeros(65, 2, dtype=torch.int64), "65 channels"),
])
def test_malformed_codes_name_the_place(value, needle):
    with pytest.raises(InvalidMessageError, match="^where") as err:
        parse_codes(value, Where(("where",)))
    assert needle in str(err.value)


def test_a_message_part_carries_parsed_codes_or_says_what_is_wrong():
    part = {"type": "input_audio_codes", "input_audio_codes": {"codes": ROWS}}
    (ref,) = parse_messages([{"role": "user", "content": [part]}]).media
    assert ref.kind.value == "audio" and ref.codes is not None and ref.codes.frames == 5
    for body, needle in (({"codes": ROWS, "format": "encodec"}, "format must be 'mimo_rvq'"),
                         ([ROWS], "must be an object"), ({"codes": [[1.5]]}, "codes[0] holds a float")):
        with pytest.raises(InvalidMessageError, match="messages\\[0\\].content\\[0\\]") as err:
            parse_messages([{"role": "user", "content": [{"type": "input_audio_codes", "input_audio_codes": body}]}])
        assert needle in str(err.value)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.data())
def test_bytes_round_trip_and_tell_shapes_apart(channels, frames, data):
    values = data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=channels * frames,
                                max_size=channels * frames))
    codes = AudioCodes(torch.tensor(values, dtype=torch.int32).view(frames, channels))
    again = AudioCodes.from_bytes(codes.to_bytes())
    assert torch.equal(again.codes, codes.codes)
    if frames > 1 and channels > 1 and frames != channels:  # the same values in another shape: other codes
        other = AudioCodes(codes.codes.reshape(channels, frames))
        assert content_key(other.to_bytes()) != content_key(codes.to_bytes())


def test_bytes_that_are_not_codes_are_refused():
    good = AudioCodes(torch.ones(3, 2, dtype=torch.int32)).to_bytes()
    for bad in (b"", b"RIFF....WAVE", good[:-1], good + b"\0"):
        with pytest.raises(InvalidMediaError):
            AudioCodes.from_bytes(bad)


def test_model_checks_name_channels_codebooks_and_duration():
    codes = parse_codes(ROWS, X)
    check_codes(codes, (8, 8, 8), 25.0, 1.0)
    for books, seconds, error, needle in (
            (None, 1.0, InvalidMediaError, "reference audio path"),
            ((8, 8), 1.0, InvalidMediaError, "3 channels; this model reads 2 RVQ stages"),
            ((8, 7, 8), 1.0, InvalidMediaError, "channel 1 span [0, 7]; its codebook has 7 entries (0..6)"),
            ((8, 8, 8), 0.12, MediaTooLarge, "5 frames (0.2 s at 25 frames/s), over the 0.12 s limit")):
        with pytest.raises(error) as err:
            check_codes(codes, books, 25.0, seconds)
        assert needle in str(err.value)
    negative = parse_codes([[0, -1]], X)
    with pytest.raises(InvalidMediaError, match="channel 0 span \\[-1, 0\\]"):
        check_codes(negative, (4,), 25.0, 1.0)


def test_code_segments_cut_at_the_segment_length():
    codes = AudioCodes(torch.arange(50 * 2, dtype=torch.int32).view(50, 2))
    parts = code_segments(codes, 24)
    assert [p.shape[0] for p in parts] == [24, 24, 2] and torch.equal(torch.cat(parts), codes.codes)
