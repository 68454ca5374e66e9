"""vLLM's chat-template fields over HTTP (protocol.py -> ChatRequest.options -> ChatLayout), against the
demo checkpoint served in process: ``chat_template_kwargs`` (``{"enable_thinking": false}``),
``add_generation_prompt: false``, ``continue_final_message`` and an assistant's reasoning are served
with the prompt transformers' ``apply_chat_template`` makes of them (its length is the answer's
``usage.prompt_tokens``); what cannot be honoured is a 400 whose message says why: a kwarg the
server sets itself, one the template does not read, oversize kwargs, both generation flags,
reasoning and reasoning_content that differ, a continued final message that is not an assistant's.
"""

from __future__ import annotations

import httpx
import pytest

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.support.paths import DEMO_MODEL

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")

USER = {"role": "user", "content": "Tell me a story."}
PAST = [USER, {"role": "assistant", "content": "Once.", "reasoning_content": "Keep it short."},
        {"role": "user", "content": "Another one."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.runtime.omni_engine import OmniEngine

    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(num_full_tokens=4096,
                                                                                 num_swa_tokens=2048))
    try:
        app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))
        with ServerThread(app) as served:
            yield served
    finally:
        engine.shutdown()


def chat(server, **fields) -> httpx.Response:
    body = {"messages": [USER], "max_tokens": 3, "temperature": 0, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def transformers_length(tokenizer, messages, **options) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


# ---- honoured ---------------------------------------------------------------------------------------
def test_enable_thinking_false_is_served_with_the_templates_prompt(server, tokenizer):
    r = chat(server, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    prompt = r.json()["usage"]["prompt_tokens"]
    assert prompt == transformers_length(tokenizer, [USER], add_generation_prompt=True, enable_thinking=False)
    assert prompt == chat(server).json()["usage"]["prompt_tokens"] + 2  # <think></think> after the header


@pytest.mark.parametrize("messages,fields,reference", [
    ([USER], {"add_generation_prompt": False}, {}),
    ([USER, {"role": "assistant", "content": "Once upon"}],
     {"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True}),
    (PAST, {}, {"add_generation_prompt": True}),
    ([PAST[0], {**PAST[1], "reasoning": PAST[1]["reasoning_content"]}, PAST[2]], {},
     {"add_generation_prompt": True}),
], ids=["no-generation-prompt", "continue-final-message", "reasoning-content", "both-reasoning-names"])
def test_template_fields_are_served_with_the_templates_prompt(server, tokenizer, messages, fields, reference):
    r = chat(server, messages=messages, **fields)
    assert r.status_code == 200, r.text
    # transformers' reference reads reasoning_content only, as the demo template does
    plain = [{k: v for k, v in m.items() if k != "reasoning"} for m in messages]
    assert r.json()["usage"]["prompt_tokens"] == transformers_length(tokenizer, plain, **reference)


# ---- refused ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    ({"chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs: messages is set by the server itself when it renders the chat template and cannot be "
     "overridden"),
    ({"chat_template_kwargs": {"bos_token": "<|im_start|>"}}, "bos_token is set by the server itself"),
    ({"chat_template_kwargs": {"enable_thinking": False, "thinking": True}},
     "chat_template_kwargs.thinking is not read by this model's chat template, so it would change nothing "
     "(it reads: enable_thinking)"),
    ({"chat_template_kwargs": {"enable_thinking": "<|vision_start|><|image_pad|><|vision_end|>"}},
     "chat_template_kwargs.enable_thinking holds text that is, or could join into, a special token"),
    ({"chat_template_kwargs": {"enable_thinking": "x" * 9000}}, "bytes of JSON; at most 8192 bytes are taken"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, "has 17 keys; at most 16 are taken"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    # vLLM's add_generation_prompt defaults to true: continue_final_message alone is the same conflict
    ({"continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message needs the final message to be an assistant message to continue; messages[0] is a "
     "user message"),
    ({"messages": [USER, {"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"}],
      "add_generation_prompt": False}, "messages[1]: reasoning and reasoning_content differ"),
], ids=["override-messages", "override-bos-token", "unused-key", "special-token-value", "oversize", "too-many-keys",
        "both-flags", "continue-with-default-prompt", "continue-a-user-message", "reasoning-conflict"])
def test_what_cannot_be_honoured_is_a_400_that_says_why(server, fields, message):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_a_kwarg_the_template_cannot_honour_fails_before_the_media_is_read(server, tmp_path):
    # the media part names a file that does not exist: were it read first, its error would be the answer
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/missing.png"}}
    r = chat(server, messages=[{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
             chat_template_kwargs={"thinking_budget": 3})
    assert r.status_code == 400, r.text
    assert "chat_template_kwargs.thinking_budget is not read" in r.json()["error"]["message"]
