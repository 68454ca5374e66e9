"""What the LLM router matches on: a request's prompt as a chain of block hashes.

The engine's prefix cache reuses KV page by page from the start of the prompt, and an encoder unit
is reusable wherever the same media bytes appear. So the router sees a prompt as blocks: text as
token ids cut into ``block_tokens`` runs, each media item as one block named by its content key
(what the bytes are, not how they were sent) weighted by ``media_weight`` tokens. Block ``i``'s hash
covers blocks ``0..i`` (a chain), so two prompts share hash ``i`` exactly when they share the first
``i + 1`` blocks: a flat set of chain hashes *is* the radix tree of dispatched prefixes, which is
what lets its state live in Redis as plain keys (mm_pipeline/cluster/serving/router_state.py).

The ingress builds the key from the parsed messages with the tokenizer only: no media is decoded
here (that is the encoder's and the LLM replica's work). It does so off its event loop (tokenizing
is CPU work proportional to the prompt), and the work is bounded: a key covers at most
``MAX_KEY_TOKENS`` token-equivalents from the start of the prompt, and no more of a text is
tokenized than that needs. A prefix key loses nothing by it: the router matches leading blocks, a
conversation longer than the cap keeps its key (so it stays where its KV is), and a prompt that long
is beyond most models' context anyway -- while a multi-megabyte prompt no longer costs the ingress
seconds of tokenizing before the replica rejects it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mm_pipeline.media.audio_codes import AudioCodes

BLOCK_TOKENS = 16  # the engine's page size: a partial page is never cached, so it never matches
MEDIA_WEIGHT = 64  # token-equivalents of one media block: media prefill dominates a prompt's cost
MAX_KEY_TOKENS = 1 << 16  # token-equivalents a key covers at most (4,096 blocks; module doc)
MAX_CHARS_PER_TOKEN = 16  # characters a key reads per token of its cap at most: long-token text is cut there


@dataclass(frozen=True)
class RouteKey:
    """``hashes[i]`` names blocks ``0..i``; ``weights[i]`` is block ``i``'s size in tokens."""

    hashes: tuple[int, ...]
    weights: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.weights):
            raise ValueError("RouteKey needs one weight per hash")

    @property
    def total(self) -> int:
        return sum(self.weights)

    def weight_of(self, blocks: int) -> int:
        """Tokens covered by the first ``blocks`` blocks."""
        return sum(self.weights[:blocks])


def _h(prev: int, tag: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(prev.to_bytes(8, "little") + tag, digest_size=8).digest(), "little")


def _block_tag(kind: bytes, tokens: Sequence[int]) -> bytes:
    return kind + b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)


def key_of_pieces(pieces: Sequence[tuple[str, Any]], block_tokens: int = BLOCK_TOKENS,
                  media_weight: int = MEDIA_WEIGHT, salt: str | None = None) -> RouteKey:
    """``pieces``: ``("tokens", [ids])`` or ``("media", content_key)`` in prompt order. Tokens run
    across pieces (a page spans a message boundary in the engine too); a media piece flushes the
    partial run before it, as a placeholder run starts at the media's position. Linear in the
    tokens: full blocks are read by index, only the partial tail (< ``block_tokens``) is carried.
    ``salt`` (a request's ``cache_salt``) seeds the chain: the replicas' caches share KV only
    within one salt, so the router matches prefixes only within one too."""
    hashes: list[int] = []
    weights: list[int] = []
    prev = 0 if salt is None else _h(0, b"s" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest())
    run: list[int] = []  # the partial block the next piece continues

    for kind, value in pieces:
        if kind == "tokens":
            ids = run + [int(t) for t in value]
            full = len(ids) - len(ids) % block_tokens
            for start in range(0, full, block_tokens):
                prev = _h(prev, _block_tag(b"t", ids[start:start + block_tokens]))
                hashes.append(prev)
                weights.append(block_tokens)
            run = ids[full:]
        elif kind == "media":
            if run:  # the partial run before the media is part of what the media block follows
                prev = _h(prev, _block_tag(b"p", run))
                hashes.append(prev)
                weights.append(len(run))
                run = []
            prev = _h(prev, b"m" + str(value).encode())
            hashes.append(prev)
            weights.append(media_weight)
        else:
            raise ValueError(f"unknown route piece kind {kind!r}")
    return RouteKey(tuple(hashes), tuple(weights))


def encode_capped(text: str, encode: Callable[[str], list[int]], max_tokens: int,
                  max_chars: int | None = None) -> tuple[list[int], int]:
    """The first ``max_tokens`` tokens of ``text`` (fewer if it ends first) and the characters read
    for them, reading only a prefix of it: chunks of twice the characters still needed (a token is
    at least one character in the common case, so dense text needs one chunk and typical text a
    few halving ones), at most ``max_chars`` in all (default ``MAX_CHARS_PER_TOKEN`` per token). A
    text under the first chunk -- nearly every message -- is tokenized whole, as before. The cuts
    depend only on the text before them, so prompts that share a prefix get the same tokens for it."""
    chars_left = max_tokens * MAX_CHARS_PER_TOKEN if max_chars is None else max_chars
    ids: list[int] = []
    pos = 0
    while pos < len(text) and len(ids) < max_tokens and chars_left > 0:
        size = min(max(2 * (max_tokens - len(ids)), 256), chars_left)
        ids.extend(encode(text[pos:pos + size]))
        read = min(size, len(text) - pos)
        pos += read
        chars_left -= read
    return ids[:max_tokens], pos


def media_key(part: dict) -> str | None:
    """The content key of a media content part, from what the request carries: the bytes of a data
    URL (hashed as sent: the same upload sent twice is the same key), a file id, or a URL. The
    encoder cache keys on the decoded bytes' blake3; routing only needs the same media to give the
    same key, which this does without decoding anything. Pre-tokenized audio codes (parsed by the
    request model already) are named by their canonical bytes."""
    kind = part.get("type")
    ref: Any
    if kind == "file":
        f = part.get("file") or {}
        ref = f.get("file_id") or f.get("file_data") or ""
    elif kind in ("image_url", "video_url", "audio_url", "input_audio"):
        inner = part.get(kind) or {}
        ref = inner.get("url") or inner.get("data") or ""
    elif kind == "input_audio_codes" and isinstance(part.get(kind), dict):
        codes = part[kind].get("codes")
        ref = codes.to_bytes() if isinstance(codes, AudioCodes) else codes
    else:
        return None
    return hashlib.blake2b(ref if isinstance(ref, bytes) else str(ref).encode(), digest_size=16).hexdigest()


def key_of_messages(messages: list[dict], encode: Callable[[str], list[int]],
                    block_tokens: int = BLOCK_TOKENS, media_weight: int = MEDIA_WEIGHT,
                    max_tokens: int = MAX_KEY_TOKENS, salt: str | None = None) -> RouteKey:
    """The route key of OpenAI chat ``messages``: each message's role and text parts as tokens
    (``encode``: the model's tokenizer), its media parts as content keys; the first ``max_tokens``
    token-equivalents of them (a media part counts ``media_weight``), reading at most
    ``MAX_CHARS_PER_TOKEN`` characters per token in all, however many messages there are.
    ``salt``: the request's ``cache_salt`` (``key_of_pieces``)."""
    pieces: list[tuple[str, Any]] = []
    left, chars_left = max_tokens, max_tokens * MAX_CHARS_PER_TOKEN

    def text(t: str) -> None:
        nonlocal left, chars_left
        ids, read = encode_capped(t, encode, left, chars_left)
        left, chars_left = left - len(ids), chars_left - read
        pieces.append(("tokens", ids))

    for m in messages:
        if left <= 0 or chars_left <= 0:
            break
        text(f"<{m.get('role', '')}>")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        for part in parts:
            if left <= 0 or chars_left <= 0:
                break
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                text(str(part.get("text", "")))
            else:
                key = media_key(part)
                if key is not None:
                    pieces.append(("media", key))
                    left -= media_weight
    return key_of_pieces(pieces, block_tokens, media_weight, salt)


def key_of_prompt(prompt: str | list[int], encode: Callable[[str], list[int]],
                  block_tokens: int = BLOCK_TOKENS, max_tokens: int = MAX_KEY_TOKENS,
                  salt: str | None = None) -> RouteKey:
    ids = encode_capped(prompt, encode, max_tokens)[0] if isinstance(prompt, str) else list(prompt[:max_tokens])
    return key_of_pieces([("tokens", ids)], block_tokens, salt=salt)
