"""OpenAI-format chat messages -> typed turns of text and media references (``ChatRequest``).

Accepted content parts (``content`` may also be a plain string):

    {"type": "text", "text": ...}
    {"type": "image_url", "image_url": {"url": data: | file:// | http(s):// | /abs/path}}
    {"type": "video_url", "video_url": {"url": ...}}          (common extension)
    {"type": "audio_url", "audio_url": {"url": ...}}          (common extension)
    {"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3" | ...}}
    {"type": "file", "file": {"file_id": ...} | {"file_data": <base64 or data URL>}}
    {"type": "input_audio_codes", "input_audio_codes": {"codes": [[...], ...], "format": "mimo_rvq"}}
                                                             (mmserve extension: media/audio_codes.py)
    {"type": "image" | "video" | "audio", "image": <url, path or bytes>}   (offline convenience)
    {"type": "refusal", "refusal": ...}                       (assistant messages: rendered as text)

Roles are ``ROLES`` (the server's request model takes its list from here): ``developer`` is read as
``system`` (OpenAI's newer name for it); a ``tool`` message is a tool's answer (the chat template
wraps it in ``<tool_response>``; its ``tool_call_id`` is not rendered, as by the template itself).
An assistant message's ``refusal`` is what it said, kept as text as its refusal parts are.

An assistant message's ``reasoning_content`` (or ``reasoning``, vLLM's newer name for the same
text; both given must agree) reaches the chat template as ``reasoning_content``, which the MiMo
template renders as ``<think>...</think>``; its text is kept literal as the content is
(prompt/chat_template.py). Message fields the prompt layout does not hand to the chat template are
refused by name rather than dropped, since dropping them changes the prompt the client asked for
(``UNRENDERED``): the deprecated ``function_call`` (the template has no place for it). Empty values
are what leaving the field out renders, and are accepted.

An assistant message's ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function": {"name",
"arguments": a JSON object as a string}}]``) reach the template as ``tool_calls`` with
``arguments`` parsed into an object (as vLLM hands them to a template), which the MiMo template
renders back as ``<tool_call><function=NAME><parameter=P>value</parameter>...``: at most
MAX_TOOL_CALLS per message, names as OpenAI's, arguments a JSON object (``ChatTurn.tool_calls``).

How the chat is templated (the generation prompt, continuing the final message,
``chat_template_kwargs``) is the request's ``TemplateOptions`` (prompt/template_options.py), carried
on the ``ChatRequest``: ``continue_final_message`` needs the final message to be an assistant's.

Nothing is read or decoded here (that happens off the event loop); this only checks shapes, so a
malformed message fails fast with HTTP 400 before any work starts. The declared kind of a part
(image_url -> image) is checked against the sniffed content later; ``file`` parts take whatever
their content sniffs as. The turns are all the prompt layout needs later (layout.py ``ChatLayout``):
a request's messages are parsed once, here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Union

from mm_pipeline.errors import InvalidMessageError, Where
from mm_pipeline.media.audio_codes import CODES_FORMAT, AudioCodes, parse_codes
from mm_pipeline.media.types import MediaKind, MediaSource
from mm_pipeline.prompt.template_options import (DEFAULT_OPTIONS, MAX_TOOLS_BYTES, TOOL_NAME, TemplateOptions,
                                                  check_tools)

ROLES = ("system", "user", "assistant", "tool", "developer")
# message field -> why it cannot be honoured (module doc)
UNRENDERED = {
    "function_call": "function_call is not supported (the deprecated form of tool_calls; send tool_calls)",
}
MAX_TOOL_CALLS = 128  # per assistant message
# an assistant's reasoning under its two names (vLLM's newer one last); the template reads the first
REASONING_FIELDS = ("reasoning_content", "reasoning")
_URL_PARTS = {"image_url": MediaKind.IMAGE, "video_url": MediaKind.VIDEO, "audio_url": MediaKind.AUDIO}
_PLAIN_PARTS = {"image": MediaKind.IMAGE, "video": MediaKind.VIDEO, "audio": MediaKind.AUDIO}


@dataclass(frozen=True)
class MediaRef:
    """A media part before ingest: a source, an uploaded file id the engine's resolver maps, or
    pre-tokenized audio codes (already parsed: nothing to read)."""

    kind: MediaKind | None
    source: MediaSource | None = None
    file_id: str | None = None
    codes: AudioCodes | None = field(default=None, repr=False)
    # the part it came from (``messages[1].content[0]``): the errors of its media name it
    loc: Where = field(default=Where(), compare=False)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.source, self.file_id, self.codes)) != 1:
            raise ValueError("MediaRef needs exactly one of source, file_id and codes")


Part = Union[str, MediaRef]


@dataclass(frozen=True)
class ChatTurn:
    role: str
    parts: tuple[Part, ...]
    reasoning: str | None = None  # an assistant's reasoning_content (module doc)
    # an assistant's tool calls as the template takes them: {"id"?, "type": "function",
    # "function": {"name", "arguments": {...}}} (module doc)
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    turns: tuple[ChatTurn, ...]
    options: TemplateOptions = DEFAULT_OPTIONS

    @property
    def media(self) -> list[MediaRef]:
        """Media references in prompt order."""
        return [p for t in self.turns for p in t.parts if isinstance(p, MediaRef)]

    @property
    def texts(self) -> list[str]:
        """Every text the chat template renders from the messages: text parts and reasoning."""
        return [s for t in self.turns
                for s in ((t.reasoning,) if t.reasoning is not None else ()) + t.parts if isinstance(s, str)]


class ParsedMessages(tuple):
    """Message dicts together with their parse (and the request's template options, which the
    parse carries): ``parse_messages`` hands back ``chat`` instead of parsing again. The server
    parses a long conversation on a worker thread (chat_service.py) and passes this on as the
    messages, so the engine's own ``parse_messages`` (on the event loop) costs nothing, while an
    engine that reads the dicts (the cluster's RemoteEngine) still can. The dicts must not change
    afterwards; pickled, it is a plain tuple (another process parses it again), or with options other
    than the defaults a ParsedMessages again, so that the options reach the other process too."""

    chat: ChatRequest

    def __new__(cls, messages: Any, options: TemplateOptions = DEFAULT_OPTIONS) -> "ParsedMessages":
        chat = parse_messages(messages, options)
        self = super().__new__(cls, messages)
        self.chat = chat
        return self

    def __reduce__(self) -> tuple:
        if self.chat.options.is_default:
            return tuple, (tuple(self),)
        return ParsedMessages, (tuple(self), self.chat.options)


def parse_messages(messages: Any, options: TemplateOptions | None = None) -> ChatRequest:
    """Validate OpenAI chat ``messages`` and turn them into a :class:`ChatRequest` templated with
    ``options`` (None: the defaults; a ``ParsedMessages`` keeps its own)."""
    if isinstance(messages, ParsedMessages) and options is None:
        return messages.chat
    options = DEFAULT_OPTIONS if options is None else options
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidMessageError("messages must be a non-empty list of {role, content} objects", loc=("messages",))
    turns = []
    for i, msg in enumerate(messages):
        where = Where(("messages", i))
        if not isinstance(msg, dict):
            raise InvalidMessageError(f"{where} must be an object, got {type(msg).__name__}", loc=where)
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidMessageError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                                      loc=where.then("role"))
        for name, why in UNRENDERED.items():
            if msg.get(name):  # None, "" and [] render as the field left out
                raise InvalidMessageError(f"{where}.{name}: {why}", loc=where)
        parts = _parts(msg.get("content"), where, role)
        refusal = msg.get("refusal")
        if refusal is not None:
            if role != "assistant" or not isinstance(refusal, str):
                raise InvalidMessageError(f"{where}.refusal must be a string, in an assistant message", loc=where)
            parts += (refusal,)
        turns.append(ChatTurn("system" if role == "developer" else role, parts, _reasoning(msg, where, role),
                              _tool_calls(msg.get("tool_calls"), where, role)))
    if options.continue_final_message and turns[-1].role != "assistant":
        raise InvalidMessageError(f"continue_final_message needs the final message to be an assistant message to "
                                  f"continue; messages[{len(turns) - 1}] is a {messages[-1]['role']} message")
    return ChatRequest(tuple(turns), options)


def _tool_calls(calls: Any, where: Where, role: str) -> tuple[dict[str, Any], ...]:
    """An assistant's ``tool_calls`` (module doc) as the template takes them; () when absent or empty."""
    if not calls:
        return ()
    where = where.then("tool_calls")
    if role != "assistant":
        raise InvalidMessageError(f"{where}: only an assistant message carries tool calls", loc=where)
    if not isinstance(calls, (list, tuple)):
        raise InvalidMessageError(f"{where} must be a list", loc=where)
    if len(calls) > MAX_TOOL_CALLS:
        raise InvalidMessageError(f"{where} has {len(calls)} calls; at most {MAX_TOOL_CALLS} are taken", loc=where)
    out = []
    for i, call in enumerate(calls):
        at = where.then(i)
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise InvalidMessageError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                      f'"arguments": ...}}}}', loc=at)
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidMessageError(f"{at}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {str(name)[:80]!r}",
                                      loc=at)
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            if len(args) > MAX_TOOLS_BYTES:
                raise InvalidMessageError(f"{at}.function.arguments is longer than {MAX_TOOLS_BYTES} characters",
                                          loc=at)
            try:
                args = json.loads(args)
            except ValueError:
                raise InvalidMessageError(f"{at}.function.arguments is not valid JSON", loc=at) from None
            except RecursionError:  # ~1000 levels of [ or {: deeper than the parser's stack
                raise InvalidMessageError(f"{at}.function.arguments nests too deeply", loc=at) from None
        if not isinstance(args, dict):
            raise InvalidMessageError(f"{at}.function.arguments must be a JSON object (as a string)", loc=at)
        try:  # the same JSON-only, bounded walk as tool definitions (their checks, reused)
            checked = check_tools([{"type": "function", "function": {"name": name, "parameters": args}}])[0]
        except InvalidMessageError as exc:  # its path names the stand-in tool: put the arguments' in its place
            stand_in = "tools[0].function.parameters"
            msg = str(exc)
            raise InvalidMessageError(msg.replace(stand_in, f"{at}.function.arguments", 1) if stand_in in msg
                                      else f"{at}.function.arguments: {msg}", loc=at) from None
        entry: dict[str, Any] = {"type": "function",
                                 "function": {"name": name, "arguments": checked["function"]["parameters"]}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return tuple(out)


def _reasoning(msg: dict, where: Where, role: str) -> str | None:
    """The message's reasoning (module doc): None when absent or empty (what leaving it out renders)."""
    given = {name: msg[name] for name in REASONING_FIELDS if msg.get(name)}
    for name, value in given.items():
        if not isinstance(value, str):
            raise InvalidMessageError(f"{where}.{name} must be a string", loc=where)
        if role != "assistant":
            raise InvalidMessageError(f"{where}.{name}: only an assistant message carries reasoning (the chat "
                                      f"template renders it for assistant messages only)", loc=where)
    if len(set(given.values())) > 1:
        raise InvalidMessageError(f"{where}: reasoning and reasoning_content differ; they are two names for the same "
                                  f"text (send one of them)", loc=where)
    return next(iter(given.values()), None)


def _parts(content: Any, where: Where, role: str) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,)
    if not isinstance(content, (list, tuple)):
        raise InvalidMessageError(f"{where}.content must be a string or a list of parts", loc=where)
    out: list[Part] = []
    for j, part in enumerate(content):
        out.append(_part(part, where.then("content", j), role))
    return tuple(out)


def _part(part: Any, where: Where, role: str) -> Part:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or "type" not in part:
        raise InvalidMessageError(f"{where} must be an object with a 'type'", loc=where)
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidMessageError(f"{where}.text must be a string", loc=where)
        return text
    if kind == "refusal":  # OpenAI allows it in assistant messages only; the template takes it as text
        text = part.get("refusal")
        if role != "assistant" or not isinstance(text, str):
            raise InvalidMessageError(f"{where}: a refusal part needs a string refusal, in an assistant message",
                                      loc=where)
        return text
    if kind in _URL_PARTS:
        body = part.get(kind)
        url = body.get("url") if isinstance(body, dict) else body
        source = _source_from_url(url, _URL_PARTS[kind], where.then(kind, "url"))
        return MediaRef(_URL_PARTS[kind], source=source, loc=where)
    if kind == "input_audio":
        body = part.get("input_audio")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, str) or not data:
            raise InvalidMessageError(f"{where}.input_audio.data must be a non-empty base64 string", loc=where)
        # the declared format is advisory: the content is sniffed; the payload is kept as it came
        # (no "data:;base64," + data: a copy of megabytes on the event loop, where this runs)
        return MediaRef(MediaKind.AUDIO, source=MediaSource(base64=data, kind=MediaKind.AUDIO), loc=where)
    if kind == "file":
        body = part.get("file")
        if not isinstance(body, dict):
            raise InvalidMessageError(f"{where}.file must be an object with file_id or file_data", loc=where)
        if isinstance(body.get("file_id"), str) and body["file_id"]:
            return MediaRef(None, file_id=body["file_id"], loc=where)
        data = body.get("file_data")
        if isinstance(data, str) and data:
            source = MediaSource(url=data) if data.startswith("data:") else MediaSource(base64=data)
            return MediaRef(None, source=source, loc=where)
        raise InvalidMessageError(f"{where}.file needs a file_id or file_data", loc=where)
    if kind == "input_audio_codes":
        body = part.get(kind)
        if not isinstance(body, dict):
            raise InvalidMessageError(f"{where}.{kind} must be an object with codes and format", loc=where)
        if body.get("format", CODES_FORMAT) != CODES_FORMAT:
            raise InvalidMessageError(f"{where}.{kind}.format must be {CODES_FORMAT!r}, got "
                                      f"{str(body['format'])[:40]!r}", loc=where)
        codes = parse_codes(body.get("codes"), where.then(kind, "codes"))
        return MediaRef(MediaKind.AUDIO, codes=codes, loc=where)
    if kind in _PLAIN_PARTS:
        value = part.get(kind)
        media_kind = _PLAIN_PARTS[kind]
        if isinstance(value, (bytes, bytearray)):
            return MediaRef(media_kind, source=MediaSource(data=bytes(value), kind=media_kind), loc=where)
        return MediaRef(media_kind, source=_source_from_url(value, media_kind, where.then(kind)), loc=where)
    raise InvalidMessageError(f"{where} has unsupported type {str(kind)[:40]!r} (text, image_url, video_url, "
                              f"audio_url, input_audio, input_audio_codes, file, refusal)", loc=where)


def _source_from_url(url: Any, kind: MediaKind, where: Where) -> MediaSource:
    if not isinstance(url, str) or not url:
        raise InvalidMessageError(f"{where} must be a non-empty string", loc=where)
    if url.startswith("/"):
        return MediaSource(path=url, kind=kind)  # a local path (allowed directories only)
    # the scheme is looked for in the first 64 characters: splitting a data URL at its colon copied
    # its megabytes on the event loop (~0.1 ms a repeat for a 12 s clip); no scheme is that long
    end = url.find(":", 0, 64)
    scheme = url[:end].lower() if end >= 0 else ""
    if scheme not in ("data", "file", "http", "https"):
        raise InvalidMessageError(f"{where}: unsupported URL {url[:40]!r} (data:, file://, http(s)://, or an "
                                  f"absolute path)", loc=where)
    return MediaSource(url=url, kind=kind)
