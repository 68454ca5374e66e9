"""The batched sampler: one token per sampling row, with its logprob (params.py holds what a request asks).

The sampler turns one fp32 logits row per sampling request into a token id, the chosen token's
logprob and, on request, the top-n logprobs. Logprobs are always those of the model's raw
distribution (log_softmax of the logits, before any processing below), so they do not depend on how
a token was chosen (vLLM's default ``raw_logprobs``).

Logits processing (logit_bias, min_tokens, presence / frequency / repetition penalties) runs first
for the rows that ask for it (logits_processing.py); then greedy rows take the argmax, random rows
temperature, min_p (drop tokens with prob < min_p * max prob), top-k / top-p and softmax.

Randomness: a request with a ``seed`` owns a ``torch.Generator`` and draws a vocab-sized noise row of
its own for every token it emits (``noise_row``), so its tokens do not depend on what else is in the
batch -- nor on speculative decoding, whose verification emits each token from the same row
(speculative/verify.py). Unseeded requests share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_core.engine.sampling.logits_processing import merged_rows, processed_rows
from llm_core.engine.sampling.params import SamplingParams


@dataclass
class SamplerOutput:
    """One entry per sampled row, in row order."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)


class Sampler:
    """Batched greedy / temperature / top-k / top-p sampling with per-request generators."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[Any] | None = None,
    ) -> SamplerOutput:
        """logits [R, V] (fp32) -> one token per row. ``histories``: per row, the request's tokens
        (``prompt_token_ids``, ``output_token_ids``, ``eos_token_ids``), needed by rows with
        min_tokens or a penalty (module docstring)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"sampler got logits {tuple(logits.shape)} for {len(params)} params / {len(generators)} generators"
            )
        if logits.dtype != torch.float32:  # .float() of fp32 logits would still be a dispatch
            logits = logits.float()
        raw = logits  # logprobs are the raw distribution's
        if any(p.processes_logits for p in params):
            rows, x = processed_rows(logits, params, histories)
            if all(p.greedy for p in params):  # argmax of the processed rows, no copy of the others
                ids = logits.argmax(dim=-1)
                ids[torch.tensor(rows, device=logits.device)] = x.argmax(dim=-1)
                return self._logprobs(raw, ids.tolist(), params)
            logits = merged_rows(logits, rows, x)
        elif all(p.greedy for p in params):  # the common serving case: one argmax, no index plumbing
            return self._logprobs(raw, logits.argmax(dim=-1).tolist(), params)
        rows = logits.shape[0]
        chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            chosen[idx] = logits[idx].argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            chosen[torch.tensor(random_rows, device=logits.device)] = self._sample_random(
                logits, random_rows, params, generators
            )
        token_ids = chosen.tolist()
        return self._logprobs(raw, token_ids, params)

    @staticmethod
    def argmax_suffices(params: list[SamplingParams]) -> bool:
        """Whether this sampler would take each row's argmax and nothing else from the logits: every
        row greedy, none asking for logprobs nor processing its logits. The runner then asks the
        model for the ids alone (``greedy_ids``) and never builds the logits."""
        return all(p.greedy and p.logprobs is None and not p.processes_logits for p in params)

    def sample_isolated(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[Any] | None = None,
    ) -> tuple[SamplerOutput, dict[int, Exception]]:
        """Like ``__call__``, but a row that cannot be sampled fails alone: ``(output, {row: error})``,
        the failed rows holding token -1 in ``output``.

        The batch is tried first; when it raises, each row is sampled on its own. Seeded rows get
        their generator state back before that retry, so their tokens are those the batch would have
        given them without the failing row (unseeded rows draw from the shared generator anyway)."""
        states = [None if g is None else g.get_state() for g in generators]
        try:
            return self(logits, params, generators, histories), {}
        except Exception:  # noqa: BLE001 -- which row failed is found below, row by row
            pass
        for g, state in zip(generators, states):
            if g is not None:
                g.set_state(state)
        out = SamplerOutput([-1] * len(params), [None] * len(params), [None] * len(params))
        failed: dict[int, Exception] = {}
        for i, (p, g) in enumerate(zip(params, generators)):
            try:
                one = self(logits[i:i + 1], [p], [g], None if histories is None else [histories[i]])
            except Exception as exc:  # noqa: BLE001 -- the error ends this row's request only
                failed[i] = exc
                continue
            out.token_ids[i], out.logprobs[i] = one.token_ids[0], one.logprobs[0]
            out.top_logprobs[i] = one.top_logprobs[0]
        return out, failed

    # ---- internal helpers -------------------------------------------------------------------
    def _sample_random(self, logits, rows, params, generators) -> torch.Tensor:
        x = logits[torch.tensor(rows, device=logits.device)]
        probs = self.probs(x, [params[i] for i in rows])
        # Exponential race: argmax(p / E), E ~ Exp(1), samples from p (and p = 0 never wins).
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(rows) if generators[i] is None]
        if shared:
            sj = torch.tensor(shared, device=x.device)
            noise[sj] = torch.empty(len(shared), probs.shape[1], device=x.device).exponential_(generator=self._shared)
        for j, i in enumerate(rows):
            g = generators[i]
            if g is not None:
                noise[j] = self.noise_row(g, probs.shape[1], x.device)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[R, V] fp32 (processed) logits -> the distributions the random rows draw from:
        temperature, then min_p, then top-k / top-p (``_filter``), then softmax. Row-wise, so a row's
        result does not depend on the others (speculative verification uses it for a request's verify
        rows)."""
        temps = torch.tensor([p.temperature for p in params], device=x.device, dtype=x.dtype)
        x = x / temps[:, None]
        if any(p.min_p > 0 for p in params):
            # vLLM's min_p: drop tokens whose probability is below min_p * the row's largest
            probs = torch.softmax(x, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], device=x.device, dtype=x.dtype)[:, None]
            x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
        if any(p.top_k > 1 or p.top_p < 1.0 for p in params):
            x = Sampler._filter(x, params)
        return torch.softmax(x, dim=-1)

    def noise_row(self, generator: torch.Generator | None, vocab: int, device: torch.device | str) -> torch.Tensor:
        """The next Exp(1) noise row [V] of one emitted token, on ``device``.

        A seeded request's row is drawn on its generator's device (CPU for request seeds), one call
        per emitted token, so a seed gives the same noise whatever device the logits live on and
        whoever else is in the batch; speculative verification draws through here too, one row per
        token it emits, so a seed's stream is that of plain decoding. ``None``: the shared generator,
        on ``device`` (the sampler's own device, as in ``__call__``)."""
        if generator is None:
            return torch.empty(vocab, device=device).exponential_(generator=self._shared)
        return torch.empty(vocab, device=generator.device).exponential_(generator=generator).to(device)

    @staticmethod
    def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask logits outside each row's top-k and top-p sets to -inf."""
        sorted_x, order = x.sort(dim=-1, descending=True)
        vocab = x.shape[1]
        ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=x.device)
        rank = torch.arange(vocab, device=x.device)[None, :]
        drop = rank >= ks[:, None]
        ps = torch.tensor([p.top_p for p in params], device=x.device, dtype=x.dtype)
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before* it
        # already reaches top_p (so the first token always survives).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= ps[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]) -> SamplerOutput:
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        chosen_lp: list[float | None] = [None] * len(params)
        top: list[dict[int, float] | None] = [None] * len(params)
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)
            ids = torch.tensor([token_ids[i] for i in want], device=logits.device)
            picked = lp.gather(1, ids[:, None])[:, 0].tolist()
            n_top = max(params[i].logprobs or 0 for i in want)
            top_vals = top_ids = None
            if n_top > 0:
                tv, ti = lp.topk(n_top, dim=-1)
                top_vals, top_ids = tv.tolist(), ti.tolist()
            for j, i in enumerate(want):
                chosen_lp[i] = picked[j]
                n = params[i].logprobs or 0
                if n > 0:
                    top[i] = dict(zip(top_ids[j][:n], top_vals[j][:n]))
                else:
                    top[i] = {}
        return SamplerOutput(token_ids, chosen_lp, top)
