"""vLLM's ``--chat-template`` (``OmniEngineConfig.chat_template``): a file or inline Jinja replaces the
checkpoint's template for every chat (the prompt ids say so; answers still come), a bad value is an
error naming the problem before anything loads, and the config carries the text, not the path."""

from __future__ import annotations

import pytest

from mm_pipeline import cli
from mm_pipeline.prompt.template_source import MAX_TEMPLATE_BYTES, load_chat_template
from mm_pipeline.runtime.config import OmniEngineConfig
from tests.support.paths import DEMO_MODEL
from tests.support.served import demo_engine_with

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

PREFACE = "Custom preface. "
CHAT = [{"role": "user", "content": "Name a shape."}]


def custom_template() -> str:
    return PREFACE + (DEMO_MODEL / "chat_template.jinja").read_text()


def test_a_file_or_inline_template_is_read_and_checked(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse.*line 1"):
        load_chat_template("{% for m in messages %}")
    big = tmp_path / "big.jinja"
    big.write_bytes(b"{{ x }}" + b" " * MAX_TEMPLATE_BYTES)
    with pytest.raises(ValueError, match="over"):
        load_chat_template(str(big))
    assert OmniEngineConfig.from_kwargs(chat_template=str(f)).chat_template == f.read_text()  # the text travels
    args = cli.parse_args(["serve", "--model", "m", "--chat-template", str(f)])
    assert cli.engine_config(args).chat_template == f.read_text()


def test_the_template_replaces_the_checkpoints(demo_engine, tokenizer):
    import asyncio

    with demo_engine_with(chat_template=custom_template()) as custom:
        plain = asyncio.run(demo_engine.prompt_token_ids(messages=CHAT))
        ids = asyncio.run(custom.prompt_token_ids(messages=CHAT))
        preface = tokenizer.encode(PREFACE.strip(), add_special_tokens=False)
        assert ids[:len(preface)] == preface and ids != plain
        assert tokenizer.decode(ids).startswith(PREFACE) and tokenizer.decode(ids).endswith(tokenizer.decode(plain))
