"""Which draft tokens the target accepts: an accepted prefix plus one token of the target's own.

Rows of the verify step for one request (c = position of its pending token t_c, drafts d_1..d_k):

    row i = 0..k:   target logits at position c + i, i.e. the target's distribution p_i of t_{c+i+1}
    greedy:         accept d_{i+1} while d_{i+1} == argmax p_i; the first mismatch (or row k) gives
                    argmax p_i as the bonus token  ->  exactly the non-speculative greedy tokens
    sampling:       row by row, the token the plain sampler would emit there: its next noise row E_i
                    (``Sampler.noise_row``, the request's own generator when it has a seed) and
                    argmax(p_i / E_i); accept d_{i+1} while it equals that token, the first mismatch
                    (or row k) emits the sampler's token and stops. The generator advances once per
                    emitted token, exactly as in plain decoding, so a seed's tokens are those of
                    non-speculative decoding whatever k, the batch or the adaptive policy chose.

Sampling is lossless: each emitted token is the plain sampler's draw from p_i, whatever the draft was,
and a draft is accepted with probability p_i(d_{i+1}) -- the acceptance of standard rejection sampling
against the MTP head's one-hot (argmax) proposal (Leviathan et al. 2023, Chen et al. 2023).

p is the distribution the non-speculative sampler draws from (``Sampler.probs``: temperature, then
min_p, then top-k / top-p, then softmax), computed for all k + 1 rows at once; noise rows are drawn
lazily, only as many as tokens are emitted. A request whose logits are processed before that
(logit_bias, min_tokens, penalties) never drafts (``SpeculativeRunner.num_draft_tokens``), so its
rows never reach this module.
"""

from __future__ import annotations

import torch

from llm_core.engine.sampling import Sampler, SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] fp32 probabilities the sampler would draw from for ``params`` (not greedy)."""
    return Sampler.probs(logits.float(), [params] * logits.shape[0])


def verify_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Tokens to emit (1..k+1) for greedy decoding, given the argmax of each of the request's k + 1
    verify rows (``target``; the runner reads every greedy request's at once): identical to
    decoding one token at a time."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        out.append(target[i])
        if d != target[i]:
            return out
    out.append(target[len(drafts)])
    return out


def verify_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator | None, sampler: Sampler) -> list[int]:
    """Tokens to emit (1..k+1): at each row the plain sampler's own draw, drafts accepted while they
    equal it. ``generator``: the request's (seeded), or None for ``sampler``'s shared one."""
    probs = target_probs(logits, params)
    vocab = probs.shape[1]
    out: list[int] = []
    for i in range(len(drafts) + 1):
        noise = sampler.noise_row(generator, vocab, probs.device)
        token = int((probs[i] / noise).argmax())
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            return out
    return out
