"""Which draft tokens the target accepts: an accepted prefix plus one token of the target's own.

Rows of the verify step for one request (c = position of its pending token t_c, drafts d_1..d_k):

    row i = 0..k:   target logits at position c + i, i.e. the target's distribution p_i of t_{c+i+1}
    greedy:         accept d_{i+1} while d_{i+1} == argmax p_i; the first mismatch (or row k) gives
                    argmax p_i as the bonus token  ->  exactly the non-speculative greedy tokens
    sampling:       the drafts are the MTP head's argmax, a one-hot proposal q, so the standard
                    rejection rule min(1, p/q) accepts d_{i+1} with probability p_i(d_{i+1}); on a
                    rejection the token is drawn from p_i with d_{i+1} removed (the normalised
                    residual max(p - q, 0)); if all k pass, the bonus is drawn from p_k. Each emitted
                    token is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).

p is the distribution the non-speculative sampler draws from: temperature, then top-k / top-p
(``Sampler._filter``), then softmax. Random numbers come from the request's own generator when it has
a seed, else from the engine's shared one.
"""

from __future__ import annotations

import torch

from llm_core.engine.sampling import Sampler, SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] fp32 probabilities the sampler would draw from for ``params`` (not greedy)."""
    x = logits.float() / params.temperature
    if params.top_k > 1 or params.top_p < 1.0:
        x = Sampler._filter(x, [params] * x.shape[0])
    return torch.softmax(x, dim=-1)


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Tokens to emit (1..k+1) for greedy decoding: identical to decoding one token at a time."""
    target = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        out.append(target[i])
        if d != target[i]:
            return out
    out.append(target[len(drafts)])
    return out


def verify_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """Tokens to emit (1..k+1) by rejection sampling against one-hot (greedy) drafts."""
    probs = target_probs(logits, params).cpu()  # the generator lives on the CPU
    out: list[int] = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        p_d = float(probs[i, d])
        if u < p_d:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # max(p - q, 0) for a one-hot q at d
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
