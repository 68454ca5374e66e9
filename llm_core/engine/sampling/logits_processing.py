"""Logits processing before sampling, in vLLM's order, for the rows whose ``SamplingParams`` ask
for it (``processes_logits``); the sampler (sampler.py) calls ``process_logits`` and the other
rows take its plain path:

    allowed         allowed_token_ids: every other token -> -inf          (history-free)
    bad words       a bad word's last token -> -inf where the output ends with the rest of it
                    (the request's ``bad_word_ids``: the engine tokenizes ``bad_words``)
    logit_bias      logits[t] += bias                                   (history-free)
    min_tokens      while fewer than min_tokens tokens were generated: stop_token_ids and EOS (unless
                    ignore_eos) -> -inf
    repetition      tokens seen in prompt + output: logit > 0 divided by it, < 0 multiplied
    frequency       logits[t] -= frequency_penalty * count of t in the output
    presence        logits[t] -= presence_penalty * (t in the output)
    structured      tokens the request's grammar cannot take next -> -inf (structured/grammar_state.py;
                    its rows skip min_tokens' mask: the grammar decides when the output may end)

then (sampler.py) greedy rows take the argmax; random rows: temperature, min_p, top-k / top-p.

The history-dependent steps need the request's tokens (a ``history``: any object with
``prompt_token_ids``, ``output_token_ids`` and ``eos_token_ids``, e.g. the engine's Request); a
structured row needs its ``grammar`` (the Request's ``GrammarState``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from llm_core.engine.structured.grammar_state import mask_logits

if TYPE_CHECKING:
    from llm_core.engine.sampling import SamplingParams


class NoTokenAllowed(ValueError):
    """A request's own constraints (structured_outputs, allowed_token_ids, bad_words, min_tokens)
    leave no token it may take next: its error, not the server's (the engine ends it as invalid
    input). Sampling such a row would take a token its constraints forbid."""


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: Sequence[Any] | None) -> torch.Tensor:
    """[R, V] fp32 logits -> the logits with each row's logit_bias, min_tokens mask and penalties
    applied (module docstring), vectorized over the rows that have any; the other rows (and the
    input tensor) are left as they are. Row-wise: a row's result does not depend on the others."""
    if not any(p.processes_logits for p in params):
        return logits
    return merged_rows(logits, *processed_rows(logits, params, histories))


def merged_rows(logits: torch.Tensor, rows: list[int], x: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``rows`` replaced by ``x`` (a new tensor; ``x`` itself when it is every row)."""
    if len(rows) == logits.shape[0]:
        return x
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device)] = x
    return out


def processed_rows(logits: torch.Tensor, params: list[SamplingParams],
                    histories: Sequence[Any] | None) -> tuple[list[int], torch.Tensor]:
    """The rows that process their logits (at least one) and their processed logits [len(rows), V]."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    dev, vocab = logits.device, logits.shape[1]
    ps = [params[i] for i in rows]
    needs_history = [p.min_tokens > 0 or p.penalized or p.structured_outputs is not None or bool(p.bad_words)
                     for p in ps]
    if any(needs_history) and (histories is None or len(histories) != len(params)):
        raise ValueError("min_tokens, the penalties and structured outputs need each row's request (histories)")
    hs = [histories[i] for i in rows] if histories is not None else [None] * len(rows)
    x = logits[torch.tensor(rows, device=dev)]  # a copy: the input keeps its raw rows

    # allowed_token_ids: one -inf row per such row, its allowed ids 0, added
    allowed = [j for j, p in enumerate(ps) if p.allowed_token_ids is not None]
    if allowed:
        r_idx, t_idx = [], []
        for k, j in enumerate(allowed):
            ids = [t for t in ps[j].allowed_token_ids if t < vocab]
            r_idx += [k] * len(ids)
            t_idx += ids
        keep = torch.full((len(allowed), vocab), float("-inf"), device=dev, dtype=x.dtype)
        keep[torch.tensor(r_idx, device=dev, dtype=torch.long), torch.tensor(t_idx, device=dev, dtype=torch.long)] = 0
        x[torch.tensor(allowed, device=dev)] += keep

    # bad words: the last token of each banned sequence whose other tokens end the output
    r_idx, t_idx = [], []
    for j, (p, h) in enumerate(zip(ps, hs)):
        if p.bad_words:
            out = h.output_token_ids
            for seq in h.bad_word_ids:
                head = len(seq) - 1
                if seq[-1] < vocab and (head == 0 or (len(out) >= head and list(out[-head:]) == list(seq[:-1]))):
                    r_idx.append(j)
                    t_idx.append(seq[-1])
    if r_idx:
        x[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")

    # logit_bias: one scatter-add over every biased row
    r_idx, t_idx, bias = [], [], []
    for j, p in enumerate(ps):
        for tok, b in p.logit_bias:
            if tok >= vocab:
                raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})")
            r_idx.append(j)
            t_idx.append(tok)
            bias.append(b)
    if r_idx:
        x.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                     torch.tensor(bias, device=dev, dtype=x.dtype), accumulate=True)

    # min_tokens: the stop ids of the rows still short of it -> -inf
    r_idx, t_idx = [], []
    for j, (p, h) in enumerate(zip(ps, hs)):
        if p.min_tokens > 0 and p.structured_outputs is None and len(h.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(h.eos_token_ids))
            for tok in stops:
                if 0 <= tok < vocab:  # an id past the vocabulary cannot be sampled anyway
                    r_idx.append(j)
                    t_idx.append(tok)
    if r_idx:
        x[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")

    # penalties, sparse: only the tokens a penalized row has seen change (O(its tokens), not O(V))
    pen = [j for j, p in enumerate(ps) if p.penalized]
    if pen:
        keys, n_out = [], 0
        for j in pen:  # output tokens first: their keys' positions give the counts below
            out = torch.as_tensor(hs[j].output_token_ids, dtype=torch.long)
            keys.append(out[(out >= 0) & (out < vocab)] + j * vocab)
        n_out = sum(len(k) for k in keys)
        for j in pen:
            if ps[j].repetition_penalty != 1:
                h = hs[j]
                cached = getattr(h, "prompt_ids_tensor", None)  # the engine's Request keeps one
                prompt = cached() if callable(cached) else torch.as_tensor(h.prompt_token_ids, dtype=torch.long)
                keys.append(prompt[(prompt >= 0) & (prompt < vocab)] + j * vocab)  # media placeholders: no tokens
        uniq, inverse = torch.unique(torch.cat(keys), return_inverse=True)
        if len(uniq):
            counts = torch.zeros(len(uniq), dtype=torch.float32).index_add_(
                0, inverse[:n_out], torch.ones(n_out, dtype=torch.float32))
            r, t = (uniq // vocab).to(dev), (uniq % vocab).to(dev)
            per_row = lambda f: torch.tensor([f(p) for p in ps], dtype=torch.float32)[uniq // vocab]  # noqa: E731
            rp = per_row(lambda p: p.repetition_penalty).to(dev, x.dtype)
            fp = per_row(lambda p: p.frequency_penalty).to(dev, x.dtype)
            pp = per_row(lambda p: p.presence_penalty).to(dev, x.dtype)
            counts = counts.to(dev, x.dtype)
            v = x[r, t]
            v = torch.where(v > 0, v / rp, v * rp)  # rp 1 (a row without it) leaves v as it is
            x[r, t] = v - fp * counts - pp * (counts > 0).to(x.dtype)

    # structured outputs: the tokens each grammar cannot take next -> -inf (last: nothing above
    # may make a masked token finite again)
    constrained = [j for j, p in enumerate(ps) if p.structured_outputs is not None]
    if constrained:
        states = [getattr(hs[j], "grammar", None) for j in constrained]
        if any(s is None for s in states):
            raise ValueError("a structured_outputs row's request has no grammar state")
        mask_logits(x, constrained, states)
    _check_some_token_allowed(x, ps, hs)
    return rows, x


def _check_some_token_allowed(x: torch.Tensor, ps: list[SamplingParams], hs: Sequence[Any]) -> None:
    """Raise NoTokenAllowed when a row that masks tokens masked them all (only the masking rows
    are read: a bias or a penalty leaves every logit finite)."""
    masking = [j for j, p in enumerate(ps) if p.structured_outputs is not None or p.allowed_token_ids is not None
               or p.bad_words or p.min_tokens > 0]
    if not masking:
        return
    idx = torch.tensor(masking, device=x.device)
    dead = torch.isneginf(x[idx]).all(dim=-1)
    if bool(dead.any()):
        j = masking[int(dead.nonzero()[0, 0])]
        p, h = ps[j], hs[j]
        names = [n for n, on in (("structured_outputs", p.structured_outputs is not None),
                                 ("allowed_token_ids", p.allowed_token_ids is not None),
                                 ("bad_words", bool(p.bad_words)), ("min_tokens", p.min_tokens > 0)) if on]
        at = "" if h is None else f" at output token {len(h.output_token_ids)}"
        raise NoTokenAllowed(f"no token can follow{at}: the request's {' and '.join(names)} leave every token "
                             f"of the vocabulary excluded")
