"""vLLM's ``--chat-template``: a template given to the server in place of the checkpoint's, as a file
or inline (``OmniEngineConfig.chat_template`` holds the text ``load_chat_template`` gives; OmniModel
sets it on the tokenizer before the layout reads it)."""

from __future__ import annotations

from pathlib import Path

import jinja2

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file is a few KiB; this bounds a wrong path's read


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template`` value as template text: the contents of the file it names, or the
    template itself when it is written inline (it holds ``{{`` or ``{%``). A ValueError names what is
    wrong: no such file and no template markup, a file too big or not UTF-8, a Jinja syntax error."""
    path = Path(value).expanduser() if "\n" not in value and len(value) < 4096 else None
    if path is not None and path.is_file():
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat template file {path} is over {MAX_TEMPLATE_BYTES} bytes")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"chat template file {path} is not UTF-8 text") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat template {value[:80]!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from None
    return text
