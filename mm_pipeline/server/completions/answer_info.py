"""Per-answer facts sent as response headers, so the JSON/SSE body keeps OpenAI's exact shape.

    app: info = AnswerInfo() ─► service.chat(req, info) / chat_stream(req, info)
         the service fills it once the answer has started (first delta in hand), which is before
         the first byte of the body, so a streamed answer can carry it in its headers too
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_pipeline.server.request_id import REQUEST_ID_HEADER

ENCODER_CACHE_HITS_HEADER = "X-Encoder-Cache-Hits"


@dataclass
class AnswerInfo:
    """``encoder_cache_hits``: encoder units (an image, a video frame group, an audio segment) of
    the request's media taken from the encoder cache instead of being encoded for it; with ``n`` >
    1 choices the first choice's count (the media is the same for all). ``request_id``: the
    answer's id (its ``id`` field), sent as ``X-Request-Id`` so a proxy's log can name it (an answer
    without it, an error, gets the client's id, the answer's where it began, or a fresh one:
    request_id.py)."""

    encoder_cache_hits: int = 0
    request_id: str | None = None

    def headers(self) -> dict[str, str]:
        out = {ENCODER_CACHE_HITS_HEADER: str(self.encoder_cache_hits)}
        if self.request_id is not None:
            out[REQUEST_ID_HEADER] = self.request_id
        return out
