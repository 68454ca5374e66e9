"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens
before it, read off the hidden rows a prefill step computes anyway.

Row ``p`` of a request's prompt predicts token ``p + 1``, so a prefill chunk over positions
``[start, end)`` gives the logprobs of tokens ``start + 1 .. end`` -- all but the last row's
when the chunk ends the prompt (that row predicts the first generated token, which the sampler
handles):

    prompt      t0   t1   t2   t3   t4          chunk 1: rows 0..2   chunk 2: rows 3..4
    rows         0    1    2  | 3    4
    gives             t1   t2   t3 | t4   (first output token: the sampler's)

The logits are those of the raw model (vLLM's default ``raw_logprobs``: before temperature, penalties
or masks), in float32, computed a block of rows at a time so that a long chunk never holds
``rows x vocab`` floats at once. A row's rank is 1 + the number of tokens with a higher logprob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from llm_core.engine.outputs import ErrorKind, RequestError

# rows whose logits are held at once: 256 x a 152k vocabulary is ~150 MB of float32
LOGITS_BLOCK_ROWS = 256
# prompt logprobs a request may ask for in all (prompt tokens x (1 + top-n)): each is a Python float
# and dict entry held until the request ends, ~100 B apiece -- a 128k-token prompt at top-20 would
# hold ~270 MB for one client
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 21


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt logprobs one step computed for one request: tokens ``first .. first + len - 1``
    of its prompt, each with its logprob, its rank in the row's distribution and the row's top-n
    ({token id: logprob}; empty for n = 0)."""

    first: int
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[dict[int, float], ...]


def check_prompt_logprobs(num_prompt_tokens: int, params) -> RequestError | None:
    """Why a request's prompt_logprobs cannot be served: more than ``MAX_PROMPT_LOGPROB_ENTRIES``."""
    if params.prompt_logprobs is None:
        return None
    entries = num_prompt_tokens * (1 + params.prompt_logprobs)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        return RequestError(ErrorKind.INVALID_INPUT,
                            f"prompt_logprobs={params.prompt_logprobs} over a prompt of {num_prompt_tokens} tokens "
                            f"asks for {entries} logprobs; at most {MAX_PROMPT_LOGPROB_ENTRIES} per request")
    return None


def prompt_rows(request, start: int, num_new: int) -> tuple[int, int] | None:
    """The rows ``[a, b)`` (prompt positions) of a step over ``[start, start + num_new)`` whose
    logprobs ``request`` still lacks, or None (it asked for none, or has them all)."""
    if request.params.prompt_logprobs is None:
        return None
    a = max(start, request.num_prompt_logprobs - 1)  # rows before it were done by an earlier step
    b = min(start + num_new, request.num_prompt_tokens - 1)  # the last prompt row predicts an output token
    return (a, b) if a < b else None


def wanted_rows(entries: Sequence, first_rows: Sequence[int]) -> list[tuple[object, int, int, int]]:
    """(entry, row in the flat batch of its position ``a``, a, b) for every entry of a step that
    computes prompt rows ``[a, b)`` its request wants logprobs of (``prompt_rows``);
    ``first_rows[k]``: the flat row of entry k's first new token (``query_start_loc``)."""
    out = []
    for k, e in enumerate(entries):
        rows = prompt_rows(e.request, e.start, e.num_new_tokens)
        if rows is not None:
            out.append((e, first_rows[k] + rows[0] - e.start, rows[0], rows[1]))
    return out


def wants_prompt_rows(entries: Sequence) -> bool:
    """Whether a step over ``entries`` computes prompt rows some request wants logprobs of (then
    the model's last layer must run every row, not the sampling rows alone)."""
    return any(prompt_rows(e.request, e.start, e.num_new_tokens) is not None for e in entries)


def compute_prompt_logprobs(logits_rows: Callable[[int, int], torch.Tensor],
                            wanted: Sequence[tuple[object, int, int, int]]) -> dict[int, PromptLogprobs]:
    """The logprobs ``wanted`` (``wanted_rows``) asks for; ``logits_rows(start, stop)``: the logits
    of rows ``[start, stop)`` of the step's every-row output (``model.compute_logits_rows``).
    Returns id(entry) -> PromptLogprobs of prompt tokens ``a + 1 .. b``."""
    out: dict[int, PromptLogprobs] = {}
    for entry, row, a, b in wanted:
        request = entry.request
        n_top = request.params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[a + 1:b + 1], dtype=torch.long)
        lps: list[float] = []
        ranks: list[int] = []
        tops: list[dict[int, float]] = []
        for lo in range(0, b - a, LOGITS_BLOCK_ROWS):
            hi = min(b - a, lo + LOGITS_BLOCK_ROWS)
            logits = logits_rows(row + lo, row + hi).float()  # the head's fresh output: ours to overwrite
            # logprob = logit - logsumexp(row), the rank and top-n read off the logits (same order):
            # no [rows, vocab] log_softmax is written, and the logsumexp runs in place last -- on a
            # 2-core CPU each new [256, 32768] fp32 temporary cost ~7-15 ms in page faults alone
            ids = targets[lo:hi].to(logits.device)
            picked = logits.gather(1, ids[:, None])
            # counted as bytes into int32: a bool sum (or count_nonzero) first copies the mask to
            # int64, 5x the time of the compare itself
            ranks.extend(((logits > picked).view(torch.uint8).sum(dim=-1, dtype=torch.int32) + 1).tolist())
            top = logits.topk(n_top, dim=-1) if n_top else None
            peak = logits.amax(dim=-1, keepdim=True)
            lse = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True).log_().add_(peak)
            lps.extend((picked - lse)[:, 0].tolist())
            if top is not None:
                tops.extend(dict(zip(i, v)) for i, v in zip(top.indices.tolist(), (top.values - lse).tolist()))
            else:
                tops.extend({} for _ in range(hi - lo))
        out[id(entry)] = PromptLogprobs(a + 1, tuple(lps), tuple(ranks), tuple(tops))
    return out
