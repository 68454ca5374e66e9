"""How many tokens an answer used (OpenAI's ``usage`` object), counted from its choices' states:
chat_service.py takes every answer's usage from here, whole or streamed.

A prompt counts once however many choices share it (with its cached tokens); every choice's
completion tokens count. A text completion may hold several prompts, its choices in groups of
``n`` per prompt:

    choices      p0c0 p0c1 | p1c0 p1c1 | p2c0 p2c1      (3 prompts, n = 2)
    prompt       ^p0         ^p1         ^p2            each group's first choice
    completion   every choice
"""

from __future__ import annotations

from mm_pipeline.prompt.reasoning import ThinkSyntax
from mm_pipeline.server.completions.choices import ChoiceState, ChoiceStream
from mm_pipeline.server.responses import CompletionTokensDetails, Usage


def usage_of(states: list[ChoiceState]) -> Usage:
    """The usage of one prompt's choices."""
    u = Usage()
    if states:  # the prompt is counted once however many choices share it
        u.add(states[0].prompt_tokens, 0, states[0].cached_tokens)
    for s in states:
        u.add(0, s.completion_tokens, 0)
    return u


def prompts_usage(states: list[ChoiceState], per_prompt: int) -> Usage:
    """The usage of a text completion's choices, in groups of ``per_prompt`` of one prompt."""
    usage = Usage()
    for first in range(0, len(states), per_prompt):
        part = usage_of(states[first:first + per_prompt])
        usage.add(part.prompt_tokens, part.completion_tokens, part.prompt_tokens_details.cached_tokens)
    return usage


def chat_usage(choices: list[ChoiceStream], reasoning: ThinkSyntax | None) -> Usage:
    """``usage_of`` a chat answer; with a reasoning parser, its thinking tokens too."""
    u = usage_of([c.state for c in choices])
    if reasoning is not None:
        u.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(c.reasoning_tokens()
                                                                                   for c in choices))
    return u


def running_usage(choices: list[ChoiceStream], per_prompt: int) -> Usage:
    """The usage so far of a streamed answer (continuous_usage_stats): each prompt once (choices come
    in groups of ``per_prompt`` of one prompt), the tokens every choice generated up to now."""
    u = Usage()
    for first in choices[::per_prompt]:
        u.add(first.prompt_tokens, 0, first.state.cached_tokens)
    u.add(0, sum(c.state.completion_tokens for c in choices), 0)
    return u
