"""Sampling parameters: vLLM's ``SamplingParams``, validated once when made and frozen, and the
bounds a request's values are held to (a field out of range raises ``ValueError`` naming it).

A request with a ``seed`` owns a ``torch.Generator`` (``generator``), so its tokens do not depend on
what else is in the batch (sampler.py says how it is used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from llm_core.engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI documents no count; vLLM has none): bounds per-step work
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids entries (a whole vocabulary of up to 256 K tokens)
MAX_BAD_WORDS = 64  # bad_words entries, each at most MAX_BAD_WORD_CHARS characters
MAX_BAD_WORD_CHARS = 256
MAX_INT32 = 2**31 - 1  # bound of token counts, top_k and token ids: they become int tensors
SEED_LIMIT = 2**63  # seeds are 0 <= seed < 2**63 (torch.Generator.manual_seed takes an int64)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _logit_bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping (token id -> bias; ids as ints or as decimal strings, OpenAI's JSON form)
    or iterable of pairs -> sorted (id, bias) pairs; a ValueError naming logit_bias otherwise."""
    if value is None:
        return ()
    items = list(value.items()) if isinstance(value, Mapping) else list(value)
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {item!r}")
        key, bias = item
        tok = key
        if isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit():
            tok = int(key)
        if not _is_int(tok) or not 0 <= tok <= MAX_INT32:
            raise ValueError(f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), got {key!r}")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}")
        if tok in out:
            raise ValueError(f"logit_bias has token id {tok} more than once")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM's sampling epsilon)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    - ``temperature`` below ``GREEDY_BELOW`` (1e-5, 0 included) is greedy (argmax): dividing fp32
      logits by a smaller one overflows, and the NaN softmax picked token 0; ``top_k`` 0 or -1
      disables top-k; ``top_p == 1`` disables nucleus filtering.
    - ``max_tokens`` must be >= 1 (a request that may generate nothing is rejected, not silently
      finished).
    - ``stop``: strings that end generation; the text is cut before the stop string (after it with
      ``include_stop_str_in_output``, vLLM's), the token that completed it stays in ``token_ids``.
      Needs a tokenizer.
    - ``stop_token_ids``: extra ids that end generation. Like EOS, the one that ended it stays in
      ``token_ids`` but not in the text (in it too with ``include_stop_str_in_output``), as in vLLM.
    - ``logprobs``: None = none; n >= 0 = the chosen token's logprob plus the top-n per token.
    - ``prompt_logprobs`` (vLLM): None = none; n >= 0 = every prompt token's logprob given the tokens
      before it, plus the top-n (the first token has none). The request then computes its whole
      prompt (no prefix-cache hit, as in vLLM): the cache cannot give logits it never kept.
    - ``truncate_prompt_tokens`` (vLLM): None = off; k >= 1 keeps the prompt's last k tokens (left
      truncation), -1 the last the context holds with room for one token. A prompt with media
      (embedding rows) that would be cut is refused instead: a cut through an image is no prompt.
    - ``min_p`` in [0, 1] (0 = off): after temperature, drop tokens whose probability is below
      ``min_p`` times the largest (vLLM; random rows only, greedy is unchanged by it).
    - ``min_tokens`` in [0, max_tokens]: until this many tokens are generated, ``stop_token_ids`` and
      EOS (unless ``ignore_eos``) get logit -inf and stop strings are not looked for (vLLM).
    - ``logit_bias``: token id -> bias in [-100, 100] added to the logits (OpenAI); a mapping (ids as
      ints or decimal strings) or pairs, stored as sorted pairs; at most ``MAX_LOGIT_BIAS`` entries.
      The engine refuses ids outside the model's vocabulary.
    - ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI): subtracted once / once per
      occurrence for each token already generated.
    - ``repetition_penalty`` > 0 (vLLM / transformers; 1 = off): tokens in the prompt or output get
      logit / penalty when positive, logit * penalty otherwise.
    - ``allowed_token_ids`` (vLLM): only these ids may be sampled (every other gets logit -inf);
      at most ``MAX_ALLOWED_TOKEN_IDS``, non-empty; the engine refuses ids past its vocabulary.
    - ``bad_words`` (vLLM): strings never generated: the engine tokenizes each (as it is and after a
      space) and bans a sequence's last token whenever the output ends with the rest of it; at
      most ``MAX_BAD_WORDS`` of at most ``MAX_BAD_WORD_CHARS`` characters. Needs a tokenizer.
    - ``structured_outputs``: the output follows a JSON schema, any JSON object, a regex, a choice
      or a grammar (llm_core/engine/structured/); the grammar decides when the output may end, so
      ``min_tokens`` does not mask its stop tokens. Needs an engine with a tokenizer.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] | Mapping | None = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    # whether the logits are processed before sampling (logit_bias, min_tokens, a penalty): set once
    # here so that the sampler's common path asks one attribute per row
    processes_logits: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer <= {MAX_INT32}, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_INT32:
                raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT32}], got {t!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens == 0
                or not -1 <= self.truncate_prompt_tokens <= MAX_INT32):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an integer in [1, {MAX_INT32}], "
                             f"got {self.truncate_prompt_tokens!r}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(ids)}")
            if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in ids):
                raise ValueError(f"allowed_token_ids must be integers in [0, {MAX_INT32}]")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        if len(words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w or len(w) > MAX_BAD_WORD_CHARS
                                             for w in words):
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORDS} non-empty strings of at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        object.__setattr__(self, "bad_words", words)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        object.__setattr__(self, "processes_logits", bool(
            self.logit_bias or self.min_tokens > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0
            or self.repetition_penalty != 1 or self.structured_outputs is not None
            or self.allowed_token_ids is not None or bool(self.bad_words)))

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (None when unseeded)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g
