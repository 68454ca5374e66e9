"""A tokenizer's chat template with the text of messages kept literal: only the template's own
markup becomes special tokens (see :class:`ChatTemplate`); a parsed chat as the message dicts it
takes (:func:`chat_messages`)."""

from __future__ import annotations

import inspect
import itertools
import re
import threading
from typing import Any, Iterator, Mapping, Sequence

import jinja2
import jinja2.meta

from mm_pipeline.errors import InvalidMessageError
from mm_pipeline.prompt.messages import ChatRequest
from mm_pipeline.prompt.template_options import RESERVED_NAMES, TemplateOptions, template_strings

# the roles of a parsed chat (mm_pipeline/prompt/messages.py; "developer" arrives as "system")
CHAT_ROLES = ("system", "user", "assistant", "tool")
_EDGE = "\x00"  # stands for the markup around a message text when its edges are checked


class ChatTemplate:
    """A tokenizer's chat template: messages -> token ids, with the text of the messages literal.

    transformers' ``apply_chat_template`` (which vLLM and SGLang build on) renders a chat to one
    string and tokenizes it with special-token parsing on, so a special token *spelled* in a message
    is that token: on the demo tokenizer ``apply_chat_template([{"role": "user", "content":
    "x <|image_pad|>"}])`` holds the image pad id 261. A client could so forge a placeholder without
    media, break the placeholder of its own media item or forge a turn. Here only the template's
    own markup yields special tokens:

        no message text holds, or spells with its neighbours, a       the rendered string tokenized
        special token (one scan; every ordinary chat)            ->  whole: the same ids as before
        else                                                     ->  rendered again with a marker
            per text; the markup is split at its special tokens and each run between two of them
            (markup and message text together) is tokenized with special-token parsing off

    The second path gives the first's ids wherever the text spells no special token: a tokenizer
    cuts its input at added tokens before anything else, so a run's ids never depend on what lies
    beyond the special tokens around it. Only *special* added tokens are literal: the others
    (``<think>``, ``<tool_call>``) stay parsed as transformers parses them, as an assistant turn
    sent back with its reasoning markup was written by the model.

    transformers 5 offers ``apply_chat_template(..., sanitize_control_tokens=True)``, not used here:
    it marks whole tokens inside each string only, so two text parts "<|vision_" and "start|>" still
    join into the token (checked on the demo tokenizer); it sanitizes the template's non-special
    added tokens too (``<think>``, above); and it marks every string of every chat (+0.1 ms a chat,
    measured) where the scan here costs microseconds. A template that does not pass message text
    through verbatim (it trims or splits it), or a tokenizer without a fast backend, cannot keep a
    special token's spelling literal: such a chat is refused (``InvalidMessageError``, HTTP 400).

    An assistant's ``reasoning_content`` is message text too, kept literal the same way.
    ``chat_template_kwargs`` are checked against the template (:meth:`check_kwargs`, see
    prompt/template_options.py): the variables it reads are found once, from its source.

    It also measures, once, what the markup of a message costs at least (:meth:`min_tokens`) and
    whether an empty text part renders as nothing (``drops_empty_text``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special_ids = {t.content: i for i, t in added.items() if getattr(t, "special", False) and t.content}
        self._strip = {t.content: (bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
                       for t in added.values() if t.content in self._special_ids}
        # longest first: where two tokens start at one place the longer one is matched, as a tokenizer does
        names = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        # a text edge that a neighbour (markup, or the next text part) could complete into a token
        heads = {n[:k] for n in names for k in range(1, len(n))}
        tails = {n[k:] for n in names for k in range(1, len(n))}
        self._edge_re = (re.compile("(?:" + "|".join(map(re.escape, sorted(heads, key=len, reverse=True))) + ")"
                                    + _EDGE + "|" + _EDGE + "(?:"
                                    + "|".join(map(re.escape, sorted(tails, key=len, reverse=True))) + ")")
                         if heads and all(_EDGE not in n for n in names) else None)
        self._edge_chars = max((len(n) for n in names), default=1) - 1
        self._literal: Any = None  # the backend tokenizer with special-token parsing off (made on first need)
        self._literal_lock = threading.Lock()
        # per add_generation_prompt: (least special tokens of the first message, of each further one)
        self._turns = {prompt: self._measure_turns(prompt) for prompt in (True, False)}
        self.drops_empty_text = self._measure_empty_text()
        self.variables, self.reserved = self._template_names()

    # ---- rendering --------------------------------------------------------------------------
    def render_text(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
        except (jinja2.TemplateError, ValueError) as exc:  # the template's raise_exception, transformers' checks
            # the chat, its options or its kwargs are what the template refused: the client's to fix
            raise InvalidMessageError(f"the chat template cannot render this chat: {str(exc)[:300]}") from None

    def token_ids(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] = (),
                  **template_kwargs: Any) -> list[int]:
        """The chat templated and tokenized; message text literal (class doc). ``continue_final_message``:
        transformers' own cut, after the final message's last text part (:func:`chat_messages` gives
        the final message one); ``template_kwargs``: checked first (:meth:`check_kwargs`); ``tools``:
        function definitions for the template's ``tools`` (checked: :meth:`check_tools`)."""
        self.check_kwargs(template_kwargs)
        self.check_tools(tools, messages)
        if continue_final_message:
            template_kwargs = {**template_kwargs, "continue_final_message": True}
        if tools:
            template_kwargs = {**template_kwargs, "tools": [dict(t) for t in tools]}
        text = self.render_text(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        texts = _message_texts(messages)
        if not self._spells_special(texts):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._literal_ids(messages, texts, text, add_generation_prompt, template_kwargs)

    def min_tokens(self, turns: int, options: TemplateOptions | None = None) -> int:
        """Tokens a chat of ``turns`` messages takes at least, whatever they hold: the special tokens
        of their markup. Those only: a text token of the markup ("user", "\n") may merge with the
        message text beside it, a special token never does (and message text cannot remove one).
        ``options``: how it is templated (None: the least over all options). A continued final
        message is cut before its closing markup: it is counted as nothing."""
        if options is None or options.continue_final_message:
            turns -= 1
        first, per = self._turns[options is not None and options.add_generation_prompt]
        return 0 if turns <= 0 else first + (turns - 1) * per

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """``InvalidMessageError`` (400) naming the first of ``chat_template_kwargs`` this template
        would not honour: one the server passes itself (``reserved``: prompt/template_options.py's
        names, this tokenizer's special-token variables and keyword arguments, the sandbox's
        globals), one the template never reads (vLLM drops those silently; here a field is honoured
        or refused), a string that holds or could join into a special token (a variable is rendered
        as the template writes it: unlike message text, it cannot be kept literal)."""
        for key, value in kwargs.items():
            if key in self.reserved:
                raise InvalidMessageError(f"chat_template_kwargs.{key} is set by the server itself when it renders "
                                          f"the chat template and cannot be overridden")
            if self.variables is None:
                raise InvalidMessageError(f"chat_template_kwargs.{key}: this model's chat template could not be "
                                          f"read for the variables it takes, so none can be passed")
            if key not in self.variables:
                reads = sorted(self.variables - self.reserved)
                raise InvalidMessageError(f"chat_template_kwargs.{key} is not read by this model's chat template, "
                                          f"so it would change nothing (it reads: {', '.join(reads) or 'none'})")
            if any(self._spells_special([s]) for s in template_strings(value)):
                raise InvalidMessageError(f"chat_template_kwargs.{key} holds text that is, or could join into, a "
                                          f"special token of this model ({self._spelled(template_strings(value))})")

    def check_tools(self, tools: Sequence[Mapping[str, Any]], messages: list[dict[str, Any]]) -> None:
        """``InvalidMessageError`` (400) when the tool definitions, or the assistants' tool calls, hold
        text that is or could join into a special token: the template writes them as it renders them
        (unlike message text, they cannot be kept literal), so such text would become that token."""
        for where, value in [("tools", list(tools))] + [(f"messages[{i}].tool_calls", m["tool_calls"])
                                                        for i, m in enumerate(messages) if m.get("tool_calls")]:
            strings = template_strings(value)
            if any(self._spells_special([s]) for s in strings):
                raise InvalidMessageError(f"{where} holds text that is, or could join into, a special token of this "
                                          f"model ({self._spelled(strings)})")

    # ---- internals -------------------------------------------------------------------------
    def _spells_special(self, texts: list[str]) -> bool:
        """Whether a text holds a special token, or its edges could make one with their neighbours
        (false alarms only cost the slower, equal path)."""
        if self._special_re is None or not texts:
            return False
        if self._special_re.search("".join(texts)):  # within a text, or across adjacent text parts
            return True
        if self._edge_re is None:
            return False
        k = self._edge_chars
        edges = _EDGE.join(t if len(t) <= 2 * k else t[:k] + _EDGE + t[-k:] for t in texts)
        return self._edge_re.search(_EDGE + edges + _EDGE) is not None

    def _literal_ids(self, messages: list[dict[str, Any]], texts: list[str], text: str,
                     add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> list[int]:
        used = set(text)  # the marker: a private-use character the chat does not hold
        marker = next((chr(c) for c in itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))
                       if chr(c) not in used), None)
        if marker is None:
            raise InvalidMessageError(f"{self._spelled(texts)} in the message text is a special token of this "
                                      f"model, and the text holds every private-use character besides")
        marked = self.render_text(_with_markers(messages, marker), add_generation_prompt=add_generation_prompt,
                                  **template_kwargs)
        pieces = marked.split(marker)  # markup, index, markup, index, ..., markup
        order = pieces[1::2]
        if (len(pieces) != 2 * len(texts) + 1 or sorted(order) != sorted(str(k) for k in range(len(texts)))
                or "".join(p if i % 2 == 0 else texts[int(p)] for i, p in enumerate(pieces)) != text):
            raise InvalidMessageError(f"{self._spelled(texts)} in the message text is a special token of this "
                                      f"model, and its chat template does not keep message text verbatim")
        runs, specials, run = [], [], []
        for i, piece in enumerate(pieces):
            if i % 2:
                run.append(texts[int(piece)])
                continue
            at = 0
            for m in self._special_re.finditer(piece):  # type: ignore[union-attr]  (texts spell one: not None)
                run.append(piece[at:m.start()])
                runs.append("".join(run))
                run = []
                specials.append(m.group())
                at = m.end()
            run.append(piece[at:])
        runs.append("".join(run))
        for k, name in enumerate(specials):  # an lstrip / rstrip token takes the whitespace beside it
            lstrip, rstrip = self._strip[name]
            if lstrip:
                runs[k] = runs[k].rstrip()
            if rstrip:
                runs[k + 1] = runs[k + 1].lstrip()
        encodings = self._literal_backend(texts).encode_batch(runs, add_special_tokens=False)
        ids: list[int] = list(encodings[0].ids)
        for name, enc in zip(specials, encodings[1:]):
            ids.append(self._special_ids[name])
            ids.extend(enc.ids)
        return ids

    def _literal_backend(self, texts: list[str]) -> Any:
        """A copy of the fast tokenizer with special-token parsing off for good: transformers'
        ``split_special_tokens`` flips one flag on the *shared* backend per call, which a request on
        another worker thread may flip back mid-call."""
        with self._literal_lock:
            if self._literal is None:
                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise InvalidMessageError(f"{self._spelled(texts)} in the message text is a special token "
                                              f"of this model, which its tokenizer cannot read as plain text")
                from tokenizers import Tokenizer

                literal = Tokenizer.from_str(backend.to_str())
                literal.no_truncation()
                literal.no_padding()
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def _spelled(self, texts: list[str]) -> str:
        """The first special token spelled in ``texts`` (quoted), for an error message."""
        found = self._special_re.search("".join(texts)) if self._special_re is not None else None
        return repr(found.group()) if found else "text that joins into a special token"

    def _count_specials(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int | None:
        """Special tokens of ``messages`` rendered (None: the template refuses them)."""
        try:
            text = self.render_text(messages, add_generation_prompt=add_generation_prompt)
        except Exception:  # noqa: BLE001  (any template error: nothing is measured)
            return None
        return sum(1 for _ in self._special_re.finditer(text)) if self._special_re is not None else 0

    def _template_names(self) -> tuple[frozenset[str] | None, frozenset[str]]:
        """(the variables the template reads, None when its source cannot be parsed; the names the
        server binds itself). Parsed as transformers compiles it (its sandbox, its ``generation``
        tag), with Jinja's ``find_undeclared_variables``: every name looked up from the context."""
        tok = self.tokenizer
        reserved = set(RESERVED_NAMES) | set(getattr(tok, "special_tokens_map", None) or {})
        try:
            reserved |= {p.name for p in inspect.signature(tok.apply_chat_template).parameters.values()
                         if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        except (TypeError, ValueError):
            pass
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            source = tok.get_chat_template()
            env = _compile_jinja_template(source).environment
            reserved |= set(env.globals)
            variables: frozenset[str] | None = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except Exception:  # noqa: BLE001  (no template, another transformers: no kwargs can be vouched for)
            variables = None
        return variables, frozenset(reserved)

    def _measure_turns(self, add_generation_prompt: bool) -> tuple[int, int]:
        """(special tokens of the cheapest one-message chat, least a further message adds): empty
        messages of every role, appended once and twice. Unknown (a template that refuses a probe,
        or markup that shrinks): 0, which bounds nothing."""
        def chat(*roles: str) -> list[dict[str, Any]]:
            return [{"role": r, "content": []} for r in roles]

        def count(messages: list[dict[str, Any]]) -> int | None:
            return self._count_specials(messages, add_generation_prompt)

        firsts = [count(chat(r)) for r in CHAT_ROLES]
        adds = []
        base = count(chat("user"))
        for r in CHAT_ROLES:
            one, two = count(chat("user", r)), count(chat("user", r, r))
            adds += [None if base is None or one is None else one - base,
                     None if one is None or two is None else two - one]
        first = 0 if None in firsts else max(0, min(firsts))  # type: ignore[type-var]
        per = 0 if None in adds else max(0, min(adds))  # type: ignore[type-var]
        return first, per

    def _measure_empty_text(self) -> bool:
        """Whether an empty text part renders as nothing, in every role and place probed: then a
        chat's empty parts can be left out (a million of them took seconds of templating)."""
        def text(*parts: str) -> list[dict[str, str]]:
            return [{"type": "text", "text": p} for p in parts]

        for r in CHAT_ROLES:
            for before in ([], [{"role": "user", "content": text("q")}]):
                variants = [[{"role": r, "content": c}] for c in ([], text(""), text("", ""))]
                variants2 = [[{"role": r, "content": c}] for c in (text("x"), text("", "x", ""))]
                for group in (variants, variants2):
                    try:
                        rendered = {self.render_text(before + v) for v in group}
                    except Exception:  # noqa: BLE001  (a template that refuses a probe: keep every part)
                        return False
                    if len(rendered) != 1:
                        return False
        return True


def chat_messages(chat: ChatRequest, kinds: Iterator[str], keep_empty: bool) -> list[dict[str, Any]]:
    """``chat``'s turns as the message dicts a template takes: text parts, one ``{"type": kind}``
    per media part (``kinds``: the planned media's, in order), an assistant's ``reasoning_content``.
    ``keep_empty``: keep empty text parts (else they render as nothing: left out). A final message
    to continue ends with a text part, empty if need be, where transformers cuts the render (after
    its last text part: a media part after it would be cut off)."""
    messages = []
    for turn in chat.turns:
        content: list[dict[str, Any]] = []
        for part in turn.parts:
            if isinstance(part, str):
                if part or keep_empty:
                    content.append({"type": "text", "text": part})
            else:
                content.append({"type": next(kinds)})
        message: dict[str, Any] = {"role": turn.role, "content": content}
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [{**c, "function": dict(c["function"])} for c in turn.tool_calls]
        messages.append(message)
    if chat.options.continue_final_message and (not messages[-1]["content"]
                                                or messages[-1]["content"][-1]["type"] != "text"):
        messages[-1]["content"].append({"type": "text", "text": ""})
    return messages


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text of ``messages`` in order: an assistant's reasoning, string contents and text parts
    (what ChatLayout hands a template; other fields are the template's business)."""
    texts = []
    for message in messages:
        if isinstance(message.get("reasoning_content"), str):
            texts.append(message["reasoning_content"])
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, (list, tuple)):
            texts.extend(p["text"] for p in content
                         if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return texts


def _with_markers(messages: list[dict[str, Any]], marker: str) -> list[dict[str, Any]]:
    """``messages`` with text k (``_message_texts`` order) replaced by ``marker k marker``."""
    count = iter(range(1 << 62))

    def mark() -> str:
        return f"{marker}{next(count)}{marker}"

    out = []
    for message in messages:
        marked = dict(message)
        if isinstance(message.get("reasoning_content"), str):  # first: _message_texts' order
            marked["reasoning_content"] = mark()
        content = message.get("content")
        if isinstance(content, str):
            content = mark()
        elif isinstance(content, (list, tuple)):
            content = [{**p, "text": mark()}
                       if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) else p
                       for p in content]
        marked["content"] = content
        out.append(marked)
    return out
