"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a grammar.

    params.py         StructuredOutputsParams (SamplingParams.structured_outputs), ReasoningGate
    compiler.py       GrammarCompiler: constraint -> compiled grammar (worker process, time limit, cache)
    worker.py         the compile worker process
    grammar_state.py  GrammarState (a request's matcher), mask_logits (the sampler's mask)

The grammar library (xgrammar) is imported only when a request asks for a constraint.
"""

from llm_core.engine.structured.params import ReasoningGate, StructuredOutputsParams

__all__ = ["ReasoningGate", "StructuredOutputsParams"]
