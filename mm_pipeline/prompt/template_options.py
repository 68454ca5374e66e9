"""How a chat is handed to its chat template (:class:`TemplateOptions`): the generation prompt, a
final assistant message continued, and ``chat_template_kwargs`` -- vLLM's request fields of the same
names, carried on ``ChatRequest`` (prompt/messages.py) from the server to ``ChatLayout``.

``chat_template_kwargs`` are extra variables for the template (``{"enable_thinking": false}`` on
the MiMo / Qwen3 templates). They are client data reaching a Jinja sandbox, so they are bounded
here, before any template sees them:

    at most MAX_KWARGS keys and MAX_KWARGS_BYTES of compact JSON, containers nested at most
    MAX_KWARGS_DEPTH deep; JSON values only (str, finite int / float, bool, null, lists, objects
    with string keys)
    no key the server itself hands the template (RESERVED_NAMES: the messages, the generation
    prompt, tools, documents, the tokenizer's special-token variables, apply_chat_template's own
    arguments, the Jinja globals): each would replace what the server rendered with

Each is a 400 naming the key.

``tools`` (OpenAI's function definitions, rendered by the template into its system turn) are client
data too: at most MAX_TOOLS of them in MAX_TOOLS_BYTES of compact JSON, nested at most
MAX_TOOLS_DEPTH deep, each ``{"type": "function", "function": {"name", "description"?,
"parameters"?}}`` with a name matching OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` (``check_tools``); they are
carried on the options as ``tools`` and handed to the template as its ``tools`` variable. What depends on the template is checked where it is known
(``ChatTemplate.check_kwargs``, prompt/chat_template.py): a key the template never reads is a 400
too (vLLM drops such keys silently; here a field is honoured or refused), and so is a string value
that spells one of the tokenizer's special tokens (message text is kept literal; a variable is
rendered as the template writes it, so such text would become that token).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from mm_pipeline.errors import InvalidMessageError

MAX_KWARGS = 16
MAX_KWARGS_BYTES = 8192  # compact JSON, UTF-8: a handful of flags and short strings fit many times over
MAX_KWARGS_DEPTH = 6  # lists / objects inside one another, counting the value's own container

# Names the server's rendering already binds (transformers' ``apply_chat_template`` and
# ``render_jinja_template``), its keyword arguments (a kwarg of the same name collides with them),
# the special-token variables it adds (kwargs would override them) and the Jinja globals of its
# sandbox. ``ChatTemplate`` adds those of the actual tokenizer and environment to these.
RESERVED_NAMES = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "extra_special_tokens",
    "range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now",
})

_SCALARS = (str, int, float, bool, type(None))

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024  # compact JSON, UTF-8: a large agent's tool set is tens of KiB
MAX_TOOLS_DEPTH = 16  # JSON schemas nest deeper than template variables do
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class TemplateOptions:
    """vLLM's chat-template request fields. ``add_generation_prompt``: end the prompt with the
    assistant header (the default); ``continue_final_message``: the final message is an assistant
    message the model goes on writing (no closing markup after it, no new header; the two cannot
    both be true, as in vLLM and transformers); ``kwargs``: ``chat_template_kwargs``, checked
    (module doc) into a private copy that is not to be changed."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    tools: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidMessageError(
                "continue_final_message and add_generation_prompt cannot both be true: add_generation_prompt "
                "starts a new assistant message, continue_final_message goes on with the last one "
                "(add_generation_prompt defaults to true: send add_generation_prompt: false with it)")
        object.__setattr__(self, "kwargs", check_template_kwargs(self.kwargs))
        object.__setattr__(self, "tools", check_tools(self.tools))

    @property
    def is_default(self) -> bool:
        return self.add_generation_prompt and not self.continue_final_message and not self.kwargs and not self.tools


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` bounded and typed (module doc), as a new dict; else
    ``InvalidMessageError`` naming the key."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidMessageError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_KWARGS:
        raise InvalidMessageError(f"chat_template_kwargs has {len(kwargs)} keys; at most {MAX_KWARGS} are taken")
    budget = [MAX_KWARGS_BYTES]  # values left before the size is surely over: each is >= 1 byte of JSON
    out = {}
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key:
            raise InvalidMessageError("chat_template_kwargs keys must be non-empty strings")
        if key in RESERVED_NAMES:
            raise InvalidMessageError(f"chat_template_kwargs.{key} is set by the server itself when it renders the "
                                      f"chat template and cannot be overridden")
        out[key] = _json_copy(value, f"chat_template_kwargs.{key}", 0, budget)
    size = len(json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_KWARGS_BYTES:
        raise InvalidMessageError(f"chat_template_kwargs is {size} bytes of JSON; at most {MAX_KWARGS_BYTES} bytes "
                                  f"are taken")
    return out


def check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """``tools`` bounded and shaped (module doc), as a tuple of new dicts; else
    ``InvalidMessageError`` naming the place. A checked tuple is taken as it is."""
    if tools is None:
        return ()
    if type(tools) is tuple and all(type(t) is _Checked for t in tools):
        return tools
    if not isinstance(tools, (list, tuple)):
        raise InvalidMessageError(f"tools must be a list of function definitions, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidMessageError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are taken")
    budget = [MAX_TOOLS_BYTES]
    out = []
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _json_copy(tool, where, 0, budget, MAX_TOOLS_DEPTH, "tools", MAX_TOOLS_BYTES)
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidMessageError(f'{where} must be {{"type": "function", "function": {{"name": ..., '
                                      f'"description"?, "parameters"?}}}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidMessageError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got "
                                      f"{str(name)[:80]!r}")
        if name in names:
            raise InvalidMessageError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidMessageError(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidMessageError(f"{where}.function.parameters must be a JSON schema object")
        out.append(_Checked(tool))
    size = len(json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_TOOLS_BYTES:
        raise InvalidMessageError(f"tools is {size} bytes of JSON; at most {MAX_TOOLS_BYTES} bytes are taken")
    return tuple(out)


class _Checked(dict):
    """A tool definition ``check_tools`` made (so a second check is free)."""


def _json_copy(value: Any, where: str, depth: int, budget: list[int], max_depth: int = MAX_KWARGS_DEPTH,
               what: str = "chat_template_kwargs", max_bytes: int = MAX_KWARGS_BYTES) -> Any:
    """A copy of ``value`` made of JSON types only; the walk stops at ``MAX_KWARGS_DEPTH`` and once
    more values were seen than the byte bound can hold, so a huge or deep value costs little."""
    budget[0] -= 1
    if budget[0] < 0:
        raise InvalidMessageError(f"{what} holds more than {max_bytes} values; at most {max_bytes} bytes of JSON "
                                  f"are taken")
    if type(value) in _SCALARS:  # exact types: a str or int subclass may carry methods into the sandbox
        if type(value) is float and not math.isfinite(value):
            raise InvalidMessageError(f"{where} is {value}, not a JSON number")
        return value
    if type(value) not in (list, dict):
        raise InvalidMessageError(f"{where} must be a JSON value (string, number, boolean, null, list or "
                                  f"object), got {type(value).__name__}")
    if depth >= max_depth:
        raise InvalidMessageError(f"{where} nests lists / objects more than {max_depth} deep")
    if type(value) is list:
        return [_json_copy(v, f"{where}[{i}]", depth + 1, budget, max_depth, what, max_bytes)
                for i, v in enumerate(value)]
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise InvalidMessageError(f"{where} has a key that is not a string")
        out[k] = _json_copy(v, f"{where}.{k}"[:200], depth + 1, budget, max_depth, what, max_bytes)
    return out


def template_strings(value: Any) -> list[str]:
    """Every string in a checked kwargs value, object keys included (a template may render either)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in template_strings(v)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *template_strings(v))]
    return []


DEFAULT_OPTIONS = TemplateOptions()  # what a request without these fields gets, as in vLLM
