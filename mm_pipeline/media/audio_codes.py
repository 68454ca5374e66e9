"""Pre-tokenized audio: the RVQ codes of the MiMo-V2.5 audio tokenizer, sent instead of the sound.

    {"type": "input_audio_codes",
     "input_audio_codes": {"codes": [[c0_t0, c0_t1, ...], [c1_t0, ...], ...], "format": "mimo_rvq"}}

``codes[c][t]`` is RVQ stage ``c``'s code at frame ``t`` (25 frames per second): one list per stage,
all of one length. Three checks, from cheap to checkpoint-specific:

    value cap     (server, request_body._validate, before the JSON parse) bounds how many numbers a body
                  may make the parser build (max_json_values)
    parse_codes   (protocol.py / messages.py, no model needed) integers in int32, a rectangle of
                  1..MAX_CODE_CHANNELS lists of >= 1 frame -> AudioCodes, stored [frames, channels]
                  int32 (the encoder's layout, 4 bytes a code)
    check_codes   (planner, the loaded model) as many channels as the checkpoint's speech input
                  reads, each code below its stage's codebook size, frames within the duration
                  limit of decoded audio (max_duration_s)

The codes then go where decoded audio goes: a MediaItem (kind audio, format ``mimo_rvq``) whose
bytes are :meth:`AudioCodes.to_bytes`, so the content key hashes the codes themselves and the
encoder cache, the batcher and streamed prefill treat their segments as audio segments.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Sequence

import numpy as np
import torch

from mm_pipeline.errors import InvalidMediaError, InvalidMessageError, MediaTooLarge, Where

CODES_FORMAT = "mimo_rvq"
MAX_CODE_CHANNELS = 64  # structural bound before the model is known (MiMo-V2.5 reads 20)
_INT32_MAX = 2**31 - 1
_MAGIC = b"mmserve.rvq.v1\0"  # keeps codes bytes apart from any media file's bytes


class AudioCodes:
    """RVQ codes [frames, channels] int32 on the CPU, validated as a rectangle of int32 values.
    (A plain class, not a dataclass: pydantic's dump would turn a dataclass into a dict of its
    fields, and the server's parsed request hands this object on as it is.)"""

    __slots__ = ("codes",)

    def __init__(self, codes: torch.Tensor) -> None:
        if codes.dtype != torch.int32 or codes.dim() != 2 or codes.shape[0] == 0 or codes.shape[1] == 0:
            raise ValueError(f"AudioCodes wants [frames > 0, channels > 0] int32, got {tuple(codes.shape)} "
                             f"{codes.dtype}")
        self.codes = codes

    def __repr__(self) -> str:
        return f"AudioCodes(frames={self.frames}, channels={self.channels})"

    @property
    def frames(self) -> int:
        return int(self.codes.shape[0])

    @property
    def channels(self) -> int:
        return int(self.codes.shape[1])

    def to_bytes(self) -> bytes:
        """The canonical bytes (the content key is their blake3): a header with the shape, then
        the codes row-major little-endian int32."""
        head = _MAGIC + self.channels.to_bytes(4, "little") + self.frames.to_bytes(4, "little")
        return head + self.codes.contiguous().numpy().astype("<i4", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "AudioCodes":
        n = len(_MAGIC)
        if len(data) < n + 8 or not data.startswith(_MAGIC):
            raise InvalidMediaError("not serialised audio codes")
        channels, frames = int.from_bytes(data[n:n + 4], "little"), int.from_bytes(data[n + 4:n + 8], "little")
        body = memoryview(data)[n + 8:]
        if len(body) != 4 * channels * frames:
            raise InvalidMediaError(f"audio codes of {channels} x {frames} need {4 * channels * frames} bytes, "
                                    f"got {len(body)}")
        values = np.frombuffer(body, dtype="<i4").astype(np.int32).reshape(frames, channels)
        return cls(torch.from_numpy(values))


def parse_codes(value: Any, where: Where, *, ints_checked: bool = False) -> AudioCodes:
    """``codes`` as a client sends them: one list of integers per RVQ stage ([channels][frames]), or
    (offline API) a 2-D integer tensor / array of that shape, or AudioCodes already parsed. Raises
    InvalidMessageError naming ``where`` for anything else; work is bounded by the input's size.
    ``ints_checked``: the caller's schema already refused every value that is not an int
    (protocol.py's strict ints), so the per-value type pass is skipped."""
    if isinstance(value, AudioCodes):
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _from_array(torch.as_tensor(value), where)
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidMessageError(f"{where} must be a non-empty list with one list of codes per RVQ stage", loc=where)
    if len(value) > MAX_CODE_CHANNELS:
        raise InvalidMessageError(f"{where} has {len(value)} channels, more than any model reads "
                                  f"({MAX_CODE_CHANNELS})", loc=where)
    rows = []
    for c, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or not row:
            raise InvalidMessageError(f"{where}[{c}] must be a non-empty list of integer codes", loc=where.then(c))
        if len(row) != len(value[0]):
            raise InvalidMessageError(f"{where} is ragged: channel 0 has {len(value[0])} frames, channel {c} "
                                      f"has {len(row)}", loc=where)
        types = {int} if ints_checked else set(map(type, row))  # C loops; array() takes True as 1
        if types != {int}:
            bad = next(t for t in types if t is not int)
            raise InvalidMessageError(f"{where}[{c}] holds a {bad.__name__}; codes are integers", loc=where.then(c))
        try:
            rows.append(array("i", row))
        except OverflowError:
            raise InvalidMessageError(f"{where}[{c}] holds a code outside the 32-bit range",
                                      loc=where.then(c)) from None
    stacked = np.stack([np.frombuffer(r, dtype=np.int32) for r in rows])  # one copy, [channels, frames]
    return AudioCodes(torch.from_numpy(np.ascontiguousarray(stacked.T)))


def _from_array(t: torch.Tensor, where: Where) -> AudioCodes:
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise InvalidMessageError(f"{where} must be 2-D [channels, frames], got shape {tuple(t.shape)}", loc=where)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidMessageError(f"{where} must hold integers, got {t.dtype}", loc=where)
    if t.shape[0] > MAX_CODE_CHANNELS:
        raise InvalidMessageError(f"{where} has {t.shape[0]} channels, more than any model reads "
                                  f"({MAX_CODE_CHANNELS})", loc=where)
    t = t.detach().to("cpu")
    if int(t.min()) < -_INT32_MAX - 1 or int(t.max()) > _INT32_MAX:
        raise InvalidMessageError(f"{where} holds a code outside the 32-bit range", loc=where)
    return AudioCodes(t.to(torch.int32).T.contiguous())


def max_code_frames(code_frames_per_second: float, max_duration_s: float) -> int:
    """The most code frames the duration limit of decoded audio allows."""
    return math.ceil(max_duration_s * code_frames_per_second)


def check_codes(codes: AudioCodes, codebook_sizes: Sequence[int] | None, code_frames_per_second: float,
                max_duration_s: float) -> None:
    """Codes against the loaded model: ``codebook_sizes`` (None: it has no RVQ audio path) says
    how many channels it reads and the range of each; frames within ``max_duration_s``."""
    if codebook_sizes is None:
        raise InvalidMediaError("pre-tokenized audio codes need the MiMo-V2.5 reference audio path "
                                "(speech_embeddings and an audio_tokenizer/); this model's audio input is "
                                "waveforms only: send the sound as input_audio or audio_url")
    if codes.channels != len(codebook_sizes):
        raise InvalidMediaError(f"audio codes have {codes.channels} channels; this model reads "
                                f"{len(codebook_sizes)} RVQ stages (one list of codes per stage)")
    most = max_code_frames(code_frames_per_second, max_duration_s)
    if codes.frames > most:
        raise MediaTooLarge(f"audio codes are {codes.frames} frames ({codes.frames / code_frames_per_second:.1f} s "
                            f"at {code_frames_per_second:g} frames/s), over the {max_duration_s:g} s limit "
                            f"(max_duration_s)")
    low, high = codes.codes.amin(0).tolist(), codes.codes.amax(0).tolist()
    for c, size in enumerate(codebook_sizes):
        if low[c] < 0 or high[c] >= size:
            raise InvalidMediaError(f"audio codes of channel {c} span [{low[c]}, {high[c]}]; its codebook has "
                                    f"{size} entries (0..{size - 1})")


def code_segments(codes: AudioCodes, codes_per_segment: int) -> list[torch.Tensor]:
    """Codes cut where the tokenizer cut the audio (``AudioConfig.codes_per_segment`` frames a
    segment, + rest): one encoder unit each, [frames, channels]."""
    return list(torch.split(codes.codes, codes_per_segment))
