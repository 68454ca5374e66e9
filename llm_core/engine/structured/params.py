"""What a request asks its tokens to follow (pure data: no grammar library is imported here).

``StructuredOutputsParams`` is vLLM's class of the same name: exactly one of a JSON schema, any JSON
object, a regular expression, a choice of strings or an EBNF grammar (xgrammar's GBNF dialect). It
lives on ``SamplingParams.structured_outputs``; it is frozen and hashable (a schema given as a dict
is kept as its canonical JSON text), so equal constraints share one compiled grammar
(``GrammarCompiler``'s cache) and it pickles to Ray replicas as it is.

``ReasoningGate``: a reasoning model thinks before it answers, and the constraint is the answer's, as
in vLLM and SGLang with a reasoning parser. The gate names the think tags' token ids; the grammar
then holds from the first token after ``</think>`` (or from the first token when the model does not
open ``<think>`` there):

    prompt ends inside <think>    free until </think>, then the grammar
    prompt closed it              the grammar from the first token (thinking turned off: <think></think>)
    otherwise                     first token: the grammar's tokens or <think>; <think> -> free until
                                  </think>, then the grammar
    no gate                       the grammar from the first token

Whether a prompt opens or closes ``<think>`` is read from its generation prompt only (the ids after
its last boundary id, the template's special tokens): a user's text that spells ``<think>`` ends
before a special token. ``mm_pipeline``'s reasoning parser asks the same question through
``prompt_opens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from llm_core.engine.structured.schema_support import unenforced_keyword

# Bounds: the constraint's text is compiled once per distinct value (in a worker process with a time
# limit, compiler.py) and kept in a cache; these keep one request from asking for megabytes of it.
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, all choices together
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _canonical_schema(schema: Any, name: str = "structured_outputs.json") -> str:
    """A JSON schema (a mapping, or its JSON text) -> canonical JSON text; a ValueError naming the problem."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(schema, (Mapping, bool)):
        raise ValueError(f"{name} must be a JSON schema (an object), got {type(schema).__name__}")
    problem = unenforced_keyword(schema)
    if problem is not None:  # a 200 whose answer breaks its own schema is worse than a 400
        raise ValueError(f"{name} cannot be held to: {problem}")
    try:
        # key order kept: a schema's properties are generated in the order it lists them (OpenAI's rule)
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{name} cannot be written as JSON: {exc}") from None


@dataclass(frozen=True)
class ReasoningGate:
    """The think tags' token ids and the ids that bound a generation prompt (module docstring)."""

    start_id: int
    end_id: int
    boundary_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundary_ids", frozenset(int(t) for t in self.boundary_ids))

    def prompt_thinking(self, prompt_ids: Sequence[int] | None) -> str | None:
        """How the prompt's generation prompt (the ids after its last boundary id) leaves thinking:
        "open" (a ``<think>`` that no ``</think>`` follows), "closed" (it ends with ``</think>``
        after them: the template turned thinking off, e.g. ``<think></think>``) or None (neither)."""
        for token in reversed(prompt_ids or ()):
            if token == self.end_id:
                return "closed"
            if token == self.start_id:
                return "open"
            if token in self.boundary_ids:
                return None
        return None

    def prompt_opens(self, prompt_ids: Sequence[int] | None) -> bool:
        """Whether the prompt ends inside ``<think>`` (``prompt_thinking`` is "open")."""
        return self.prompt_thinking(prompt_ids) == "open"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``); give exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text): the output is a JSON value it accepts;
    - ``json_object=True``: the output is some JSON object (OpenAI's ``response_format`` json_object);
    - ``regex``: the output matches the regular expression as a whole;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, ``root ::= ...``).

    ``disable_any_whitespace``: JSON without free whitespace between tokens (vLLM's option; by default
    any whitespace is allowed, which a weak model may fill until ``max_tokens``). ``reasoning``: set
    by a server with a reasoning parser (module docstring).
    """

    json: str | Mapping | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    reasoning: ReasoningGate | None = field(default=None, compare=True)
    # the request field the constraint came from, dotted ("response_format.json_schema.schema",
    # "tools"): named in its errors (None: structured_outputs.<kind>); no part of its identity
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice and "
                             f"grammar, got {', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json, self.source or "structured_outputs.json"))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{self.source or f'structured_outputs.{name}'} must be a non-empty string")
        if self.choice is not None:
            field_name = self.source or "structured_outputs.choice"
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise ValueError(f"{field_name} must be a list of strings")
            choice = tuple(self.choice)
            if not choice or len(choice) > MAX_CHOICES:
                raise ValueError(f"{field_name} must hold 1 to {MAX_CHOICES} strings, got {len(choice)}")
            if any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"{field_name} must hold non-empty strings")
            object.__setattr__(self, "choice", choice)
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.name} is {len(self.text)} characters; at most {MAX_CONSTRAINT_CHARS} are accepted")

    @property
    def name(self) -> str:
        """What its errors call it: its ``source``, or ``structured_outputs.<kind>``."""
        return self.source or f"structured_outputs.{self.kind}"

    @property
    def kind(self) -> str:
        """Which constraint: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as text (a schema's canonical JSON, the regex, the grammar; choices as a
        JSON list; "" for json_object)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def compile_key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the gate does not change the grammar)."""
        return self.kind, self.text, self.disable_any_whitespace
