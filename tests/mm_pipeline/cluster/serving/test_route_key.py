"""The route key (mm_pipeline/cluster/serving/route_key.py) the ingress builds for every request:
the same chain of block hashes as before, in time linear in the prompt (slicing the pending run
block by block made it quadratic: 21 s for one 424k-token text), from a bounded prefix of the prompt
(a 4 MB prompt was tokenized whole, seconds of the ingress's CPU, before the replica rejected it as
longer than the model's context)."""

from __future__ import annotations

import random
import time

import pytest

from mm_pipeline.cluster.serving import route_key
from mm_pipeline.cluster.serving.route_key import RouteKey, _h, key_of_messages, key_of_pieces, key_of_prompt

# the documented caps (read from the module; the literals only stand in where it has none)
MAX_KEY_TOKENS = getattr(route_key, "MAX_KEY_TOKENS", 1 << 16)
MAX_CHARS_PER_TOKEN = getattr(route_key, "MAX_CHARS_PER_TOKEN", 16)


def _old_key_of_pieces(pieces, block_tokens=16, media_weight=64):
    """The reference: the chain as it was built before (slicing the run block by block)."""
    hashes, weights, prev, run = [], [], 0, []
    for kind, value in pieces:
        if kind == "tokens":
            run.extend(int(t) for t in value)
            while len(run) >= block_tokens:
                block, run = run[:block_tokens], run[block_tokens:]
                prev = _h(prev, b"t" + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
                hashes.append(prev)
                weights.append(block_tokens)
        else:
            if run:
                prev = _h(prev, b"p" + b"".join(int(t).to_bytes(4, "little", signed=True) for t in run))
                hashes.append(prev)
                weights.append(len(run))
                run = []
            prev = _h(prev, b"m" + str(value).encode())
            hashes.append(prev)
            weights.append(media_weight)
    return RouteKey(tuple(hashes), tuple(weights))


def test_key_of_pieces_is_the_same_chain_in_linear_time():
    rng = random.Random(7)
    for _ in range(200):
        pieces = [("media", f"m{rng.randrange(5)}") if rng.random() < 0.2
                  else ("tokens", [rng.randrange(-5, 50_000) for _ in range(rng.randrange(0, 70))])
                  for _ in range(rng.randrange(0, 8))]
        assert key_of_pieces(pieces) == _old_key_of_pieces(pieces), pieces
    ids = list(range(400_000))  # one long text piece: 21 s when the run was sliced block by block
    start = time.monotonic()
    key = key_of_pieces([("tokens", ids)])
    assert len(key.hashes) == 25_000 and time.monotonic() - start < 5.0


class Spy:
    """A tokenizer stand-in, one token per ``k`` characters, that fails once it was given more than
    ``limit`` characters in all (at once: reading a 4 MB prompt whole is the bug, not a slow test)."""

    def __init__(self, k: int, limit: int = 1 << 62) -> None:
        self.k, self.limit, self.chars = k, limit, 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        assert self.chars <= self.limit, f"the key read {self.chars:,} characters of the prompt"
        return [hash(text[i:i + self.k]) % 50_000 for i in range(0, len(text), self.k)]


@pytest.mark.parametrize("chars_per_token", [1, 4, 64])
def test_the_key_reads_a_bounded_prefix_of_the_prompt(chars_per_token):
    """The key reads at most MAX_KEY_TOKENS tokens' worth (about twice the characters those tokens
    span, at most MAX_CHARS_PER_TOKEN per token), and prompts that share their start get the same
    key for it."""
    big = "".join(random.Random(1).choices("abcdefgh ", k=4_000_000))
    bound = MAX_KEY_TOKENS * min(chars_per_token * 2 + 2, MAX_CHARS_PER_TOKEN) + 512
    for build in (lambda enc, t: key_of_prompt(t, enc),
                  lambda enc, t: key_of_messages([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": t},
                                                  {"role": "user", "content": t}], enc)):
        key = build(Spy(chars_per_token, bound), big)
        assert key.total <= MAX_KEY_TOKENS + 16 and len(key.hashes) >= MAX_KEY_TOKENS // 16 // chars_per_token - 1
        assert build(Spy(chars_per_token, bound), big[:3_000_000] + "different from here on") == key
    short = "a short prompt, well under the cap " * 20  # tokenized whole, as before
    assert key_of_prompt(short, Spy(chars_per_token)) == key_of_pieces([("tokens", Spy(chars_per_token)(short))])


def test_a_salt_seeds_the_chain_so_only_one_salt_shares_prefixes():
    encode = lambda t: [ord(c) for c in t]  # noqa: E731
    msgs = [{"role": "user", "content": "x" * 100}]
    plain, a, a2, b = (key_of_messages(msgs, encode, salt=s) for s in (None, "a", "a", "b"))
    assert a == a2 and a.weights == plain.weights
    assert not set(a.hashes) & set(plain.hashes) and not set(a.hashes) & set(b.hashes)
    assert key_of_prompt("x" * 100, encode, salt="a") != key_of_prompt("x" * 100, encode)
