"""Tool calls out of a chat answer's content: MiMo's (Qwen3-Coder's) XML calls -> OpenAI
``tool_calls`` (vLLM's ``--tool-call-parser qwen3_coder``, the format MiMo models are served with).

    ToolCallParser(tools).feed(delta text) -> ToolSplit(content, calls)    a streamed answer
    ToolCallParser(tools).finish()         -> what it held back, released at the end
    ToolCallParser(tools).parse(text)      -> the same parser fed the whole text once

It runs on the content, after the reasoning split (prompt/reasoning.py: thinking is never parsed for
calls). One implementation for both, so a streamed answer gives the calls and content of the
non-streamed one however the text was cut into deltas (tests/mm_pipeline/prompt/test_tool_calls.py
checks it with hypothesis). A call, as the chat template teaches the model to write it::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

What the parser decides:

* A block ``<tool_call>...</tool_call>`` holding at least one ``<function=NAME>`` is a call per
  function (``arguments``: a JSON object of its parameters). Inside, it reads as vLLM's qwen3_coder
  does: a function ends at ``</function>`` (or the block's end), a parameter at ``</parameter>``, the
  next ``<parameter=`` or the function's end; one newline at each edge of a value is the format's,
  not the value's.
* A parameter value is text. Where the tool's JSON schema (``tools[].function.parameters
  .properties[P].type``; the first that is not ``"null"`` of a list) says ``integer`` / ``number`` /
  ``boolean`` / ``object`` / ``array``, it is converted with ``json.loads`` where that parses to the
  type (``True`` / ``False`` in any case count as booleans, an integral number as an ``integer``,
  ``null`` in any case as null for any of these types, as vLLM); otherwise, and for a string, an
  unknown type, parameter or function, it stays a string. A function the request did not declare is
  still a call (vLLM's too): the client sees the name.
* Text outside the blocks is ``content``: what comes before the first call verbatim (vLLM keeps it
  too), whitespace after a call that only leads to another call or the end is dropped (the newline
  between two calls), any other text after a call is content (vLLM drops it; here nothing the model
  wrote is lost, and a stream cannot take back text it already sent).
* A block that holds no ``<function=`` (malformed), or one never closed (cut by ``max_tokens`` or
  a stop string), is text: its raw characters are content, as vLLM answers an output it cannot parse.
  A call already made earlier in the answer stays a call (a stream sent it).

``tool_choice`` ``"required"`` or a named function (vLLM's way): the answer is JSON a grammar forces
(``forced_call_schema``: a named function's arguments, or an array of ``{"name", "parameters"}``),
read by ``ForcedCallParser`` into the same ``tool_calls`` at the answer's end.

Held back while streaming, so tag text is never sent as content: a suffix that may begin
``<tool_call>`` (at most 10 characters), a whole block until its ``</tool_call>``, and after a call
the whitespace that may lead to the next. ``finish`` releases them as content: an unfinished tag or
block is text after all.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from llm_core.engine.structured.schema_support import SCHEMA_MAPS, VALUE_KEYWORDS
from mm_pipeline.prompt.reasoning import tag_prefix_at_end

ToolParserName = Literal["auto", "qwen3_coder", "none"]
TOOL_PARSERS: tuple[str, ...] = typing.get_args(ToolParserName)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_INTEGER = ("integer", "int")
_NUMBER = ("number", "float")
_BOOLEAN = ("boolean", "bool")
_JSON = ("object", "array", "dict", "list")


def new_call_id() -> str:
    """OpenAI-style: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object in a string."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSplit:
    """A piece of content as text and calls ("" and () where it holds none)."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __add__(self, other: "ToolSplit") -> "ToolSplit":
        return ToolSplit(self.content + other.content, self.calls + other.calls)


class _Phase(enum.Enum):
    TEXT = "text"  # content; a suffix that may begin <tool_call> is held
    CALL = "call"  # inside <tool_call>: held until </tool_call>
    AFTER = "after"  # right after a call: whitespace held until what follows it is known


class ToolCallParser:
    """One answer's content, fed as it arrives (module doc). Not thread-safe: one per choice.
    ``tools``: the request's tool definitions (OpenAI's shape), for the parameters' types."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self._types: dict[str, dict[str, Any]] = {}
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, Mapping) else None
                self._types[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
        self._phase = _Phase.TEXT
        self._held = ""
        self._searched = 0  # CALL: how much of the held block was searched for </tool_call> already

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> ToolSplit:
        content: list[str] = []
        calls: list[ToolCall] = []
        buf, self._held = self._held + text, ""
        while buf:
            if self._phase is _Phase.TEXT:
                at = buf.find(START)
                if at >= 0:
                    content.append(buf[:at])
                    buf, self._phase, self._searched = buf[at:], _Phase.CALL, len(START)
                else:
                    keep = tag_prefix_at_end(buf, START)
                    content.append(buf[:len(buf) - keep])
                    self._held, buf = buf[len(buf) - keep:], ""
            elif self._phase is _Phase.CALL:
                at = buf.find(END, max(len(START), self._searched - len(END) + 1))
                if at < 0:
                    self._held, self._searched, buf = buf, len(buf), ""
                    continue
                block, buf = buf[:at + len(END)], buf[at + len(END):]
                found = self._calls(block[len(START):at])
                if found:
                    calls.extend(found)
                    self._phase = _Phase.AFTER
                else:  # malformed: the block is text
                    content.append(block)
                    self._phase = _Phase.TEXT
            else:
                body = buf.lstrip()
                if body.startswith(START):
                    buf, self._phase, self._searched = body, _Phase.CALL, len(START)
                elif START.startswith(body):  # only whitespace, or "<tool_": not decided yet
                    self._held, buf = buf, ""
                else:  # text after the call: its whitespace is the text's
                    self._phase = _Phase.TEXT
        return ToolSplit("".join(content), tuple(calls))

    def finish(self) -> ToolSplit:
        """The end of the content: what was held is text (an unclosed block, an unfinished tag),
        except whitespace after the last call."""
        held, self._held = self._held, ""
        if self._phase is _Phase.AFTER and not held.strip():
            held = ""
        self._phase = _Phase.TEXT
        return ToolSplit(content=held)

    def parse(self, text: str) -> ToolSplit:
        """A whole content: ``feed`` once, then ``finish``."""
        return self.feed(text) + self.finish()

    # ---- one block -------------------------------------------------------------------------------
    def _calls(self, block: str) -> list[ToolCall]:
        """The calls of a closed block's inside ([] when it holds no function: malformed)."""
        calls = []
        for m in _FUNCTION.finditer(block):
            head, sep, body = m.group(1).partition(">")
            name = head.strip()
            if not sep or not name:
                return []
            props = self._types.get(name, {})
            args: dict[str, Any] = {}
            for p in _PARAMETER.finditer(body):
                pname, psep, value = p.group(1).partition(">")
                pname = pname.strip()
                if not psep or not pname:
                    return []
                value = value.removeprefix("\n").removesuffix("\n")
                args[pname] = convert_value(value, props.get(pname))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id()))
        return calls


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (module doc); a string when it does not parse."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if not isinstance(kind, str):
        return value
    kind = kind.lower()
    if kind not in _INTEGER + _NUMBER + _BOOLEAN + _JSON:
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    if kind in _BOOLEAN:
        return {"true": True, "false": False}.get(text.lower(), value)
    try:
        parsed = json.loads(text)
    except ValueError:
        return value
    if kind in _INTEGER:
        if isinstance(parsed, float) and parsed.is_integer() and abs(parsed) < 2 ** 53:
            return int(parsed)
        return parsed if type(parsed) is int else value
    if kind in _NUMBER:
        return parsed if type(parsed) in (int, float) else value
    if kind in ("object", "dict"):
        return parsed if isinstance(parsed, dict) else value
    return parsed if isinstance(parsed, list) else value


# ---- tool_choice "required" and a named function: JSON the grammar forces (vLLM's way) ---------------
def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an object schema when it declares none)."""
    params = tool["function"].get("parameters")
    return dict(params) if isinstance(params, Mapping) and params else {"type": "object"}


def forced_call_schema(tools: Sequence[Mapping[str, Any]], choice: str | None,
                       parallel: bool = True) -> dict[str, Any]:
    """The JSON schema an answer must follow when ``tool_choice`` forces calls: a named function
    (``choice``) -> its parameters object (the answer is the call's arguments); ``None``
    ("required") -> a non-empty array of ``{"name": one of the tools, "parameters": its schema}``,
    of one call only unless ``parallel`` (``parallel_tool_calls``). In the array each tool's
    schema lives under the root's ``$defs`` with its own references re-rooted there, so a schema
    with ``$defs`` / ``$ref`` (what pydantic and the OpenAI SDK write for nested models and enums)
    still resolves. A ValueError names a function the tools do not declare."""
    named = {t["function"]["name"]: t for t in tools}
    if choice is not None:
        if choice not in named:
            raise ValueError(f"tool_choice names function {choice!r}, which tools do not declare")
        return _parameters(named[choice])
    defs = {f"tool_{k}": _rerooted(_parameters(tool), f"#/$defs/tool_{k}") for k, tool in enumerate(named.values())}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
         "properties": {"name": {"type": "string", "enum": [name]}, "parameters": {"$ref": f"#/$defs/tool_{k}"}}}
        for k, name in enumerate(named)]}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def in_tool_terms(text: str) -> str:
    """``text`` (an error about "required"'s array schema) with each place under a tool's schema
    (``#/$defs/tool_k/...``) named as the request has it (``tools[k].function.parameters#/...``)."""
    return re.sub(r"#/\$defs/tool_(\d+)", r"tools[\1].function.parameters#", text)


def _rerooted(node: Any, root: str) -> Any:
    """``node`` (a schema, or a part of one) with each local reference (``#``, ``#/...``) made
    relative to ``root``, the place the schema now has in a larger one."""
    if isinstance(node, list):
        return [_rerooted(v, root) for v in node]
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, Mapping):  # names -> schemas (a property may be named "enum")
            out[key] = {name: _rerooted(sub, root) for name, sub in value.items()}
        elif key in VALUE_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rerooted(value, root)
    return out


class ForcedCallParser:
    """The parser of an answer whose calls a grammar forced (``forced_call_schema``): the whole
    content is JSON, so it is held and read at ``finish`` -- a named function's arguments object,
    or "required"'s array of calls. Content the grammar did not complete (cut by ``max_tokens`` or
    a stop string) is text, as an unparsable answer is for ``ToolCallParser``. Same interface."""

    def __init__(self, function: str | None) -> None:
        self.function = function  # None: "required"
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> ToolSplit:
        self._held += text
        return ToolSplit()

    def finish(self) -> ToolSplit:
        held, self._held = self._held, ""
        try:
            value = json.loads(held)
        except ValueError:
            return ToolSplit(content=held)
        if self.function is not None:
            if isinstance(value, dict):
                return ToolSplit(calls=(ToolCall(self.function, json.dumps(value, ensure_ascii=False), new_call_id()),))
        elif isinstance(value, list) and value and all(
                isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("parameters"), dict)
                for v in value):
            return ToolSplit(calls=tuple(ToolCall(v["name"], json.dumps(v["parameters"], ensure_ascii=False),
                                                  new_call_id()) for v in value))
        return ToolSplit(content=held)

    def parse(self, text: str) -> ToolSplit:
        return self.feed(text) + self.finish()


@dataclass(frozen=True)
class ToolCallSyntax:
    """The qwen3_coder format is on for this model (``--tool-call-parser``)."""

    name: str = "qwen3_coder"

    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCallParser:
        return ToolCallParser(tools)


def knows_tool_calls(tokenizer: Any) -> bool:
    """Whether the model was trained to call tools in ``<tool_call>``: the tag is a token of its
    vocabulary, or its chat template writes it."""
    if tokenizer is None:
        return False
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if START in vocab:
        return True
    try:
        template = tokenizer.get_chat_template() if hasattr(tokenizer, "get_chat_template") else None
    except Exception:  # noqa: BLE001  (no template)
        template = None
    return isinstance(template, str) and START in template


def resolve_tool_calls(name: str, tokenizer: Any) -> ToolCallSyntax | None:
    """``--tool-call-parser`` for a model: the syntax to parse with, or None (off; a request with
    tools is then a 400). ``auto``: on when the vocabulary or the chat template knows
    ``<tool_call>``; ``qwen3_coder``: on; ``none``: off."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}")
    if name == "none" or (name == "auto" and not knows_tool_calls(tokenizer)):
        return None
    return ToolCallSyntax()


def describe_tool_calls(name: str, syntax: ToolCallSyntax | None) -> str:
    """One line for the start-up report."""
    if syntax is None:
        why = "auto: the model knows no <tool_call>" if name == "auto" else "--tool-call-parser none"
        return f"off ({why}); requests with tools are refused"
    why = "auto: the model knows <tool_call>" if name == "auto" else "--tool-call-parser qwen3_coder"
    return f"qwen3_coder ({why}); chat answers' <tool_call> blocks become tool_calls"
