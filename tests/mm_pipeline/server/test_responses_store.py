"""OpenAI's Responses API (``/v1/responses``) served in process on test_reasoning_server.py's
scripted engine: the response store and the conversations built from it. A store of zero bytes
keeps nothing; the store's bound counts the whole response (instructions too); a long
conversation is turned into a chat and stored off the event loop; a bad input part is named by
its Responses input item, not by its chat message, whether validation or the chat parser refuses it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from mm_pipeline.errors import MediaNotFound
from mm_pipeline.prompt.messages import parse_messages
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.support.responses_api import ThinkingEngine_for, message_text


def test_a_store_of_zero_bytes_keeps_nothing(tmp_path):
    engine = ThinkingEngine_for([["Fine."]])
    with ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path), responses_store_bytes=0))) as server:
        r = httpx.post(server.base_url + "/v1/responses", json={"input": "Hi"}, timeout=30).json()
        assert r["store"] is False and message_text(r) == "Fine."
        assert httpx.get(server.base_url + f"/v1/responses/{r['id']}", timeout=30).status_code == 404


def test_the_store_charges_a_response_and_its_conversation(tmp_path):
    """The store's bound counts the whole response (instructions here): 16 KiB of instructions each,
    a 64 KiB store keeps at most three of eight, not all."""
    settings = ServerSettings(files_dir=str(tmp_path), responses_store_bytes=64 << 10)
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), settings)) as server:
        ids = [httpx.post(server.base_url + "/v1/responses", json={"input": "Hi", "instructions": "i" * (16 << 10)},
                          timeout=30).json()["id"] for _ in range(8)]
        kept = [i for i in ids if httpx.get(server.base_url + f"/v1/responses/{i}", timeout=30).status_code == 200]
        assert 0 < len(kept) <= 3 and kept == ids[-len(kept):]  # the most recent, within the bytes


def test_a_long_conversation_is_turned_into_a_chat_and_stored_off_the_event_loop(tmp_path, monkeypatch):
    """A one-item follow-up of a long stored conversation is long: its chat is built and validated,
    and its entry sized, on a thread (the event loop serves every other request meanwhile)."""
    from mm_pipeline.server.responses_api import routes

    def on_loop() -> bool:
        try:
            return asyncio.get_running_loop() is not None
        except RuntimeError:
            return False

    ran: list[tuple[str, bool]] = []

    def watched(name: str, fn):
        def run(*args):
            ran.append((name, on_loop()))
            return fn(*args)
        return run

    monkeypatch.setattr(routes, "_chat_request", watched("chat", routes._chat_request))
    monkeypatch.setattr(routes, "_sized_entry", watched("size", routes._sized_entry))
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"m{k}"} for k in range(routes._INLINE_ITEMS)]
    with ServerThread(create_app(ThinkingEngine_for([["Fine."]]), ServerSettings(files_dir=str(tmp_path)))) as server:
        first = httpx.post(server.base_url + "/v1/responses", json={"input": turns[:3]}, timeout=30).json()
        assert ran == [("chat", True), ("size", True)]  # short: inline
        ran.clear()
        # as many items as are validated inline; its entry (1,000s of values) is sized on a thread
        long = httpx.post(server.base_url + "/v1/responses", json={"input": turns}, timeout=30).json()
        assert ran == [("chat", True), ("size", True), ("size", False)]
        ran.clear()
        follow = httpx.post(server.base_url + "/v1/responses", json={"input": "And?", "previous_response_id": long["id"]},
                            timeout=30)
        assert follow.status_code == 200 and first["status"] == "completed"
        assert ran == [("chat", False), ("size", False)]  # one item, but the history's too


@pytest.mark.parametrize("bad, param", [
    ({"role": "user", "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_text", "text": 5}]},
     "input.2.content.1"),
    ({"type": "function_call_output", "call_id": "c1", "output": [{"type": "bogus"}]}, "input.2.output.0"),
])
def test_a_bad_input_part_is_named_by_its_input_item(scripted, bad, param):
    """The chat request names its messages; the error names the Responses input item (instructions
    and the stored conversation come before it in the chat)."""
    base = scripted([["Fine."]])
    first = httpx.post(base + "/v1/responses", json={"input": "Hi"}, timeout=30).json()
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"role": "user", "content": "One more."}, bad]
    r = httpx.post(base + "/v1/responses", json={"input": items, "instructions": "Be brief.",
                                                 "previous_response_id": first["id"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param + ":")


class ParsingEngine:
    """The scripted engine behind the chat parser OmniEngine.generate runs first: a part the parser
    refuses fails the request with the parser's error, named by the chat's messages."""

    def __init__(self) -> None:
        self.inner = ThinkingEngine_for([["Fine."]])
        self.model_name, self.tokenizer = self.inner.model_name, self.inner.tokenizer

    def generate(self, messages, params, **kw):
        parse_messages(messages)
        return self.inner.generate(messages, params, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("bad, param, message", [
    ({"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                  {"type": "input_image", "image_url": "ftp://host/a.png"}]},
     "input.2.content.1", "input[2].content[1]: unsupported URL 'ftp://host/a.png'"),
    ({"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "gopher://x"}]},
     "input.2.output.0", "input[2].output[0]: unsupported URL 'gopher://x'"),
])
@pytest.mark.parametrize("mode", ["plain", "stream", "background"])
def test_a_part_the_chat_parser_refuses_is_named_by_its_input_item(tmp_path, bad, param, message, mode):
    """What the chat parser refuses after validation (a URL scheme) is named as the request spells
    it, in the message and the param, answered, streamed or in the background: not
    ``messages[4].content[1].image_url.url``, a message the client never sent (instructions and the
    stored conversation come before the input in the chat)."""
    with ServerThread(create_app(ParsingEngine(), ServerSettings(files_dir=str(tmp_path)))) as server:
        post = lambda body: httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)  # noqa: E731
        first = post({"input": "Hi"}).json()
        items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                 {"role": "user", "content": "One more."}, bad]
        r = post({"input": items, "instructions": "Be brief.", "previous_response_id": first["id"],
                  "stream": mode == "stream", "background": mode == "background"})
        if mode == "background":
            rid = r.json()["id"]
            for _ in range(200):
                got = httpx.get(server.base_url + f"/v1/responses/{rid}", timeout=30).json()
                if got["status"] not in ("queued", "in_progress"):
                    break
                time.sleep(0.01)
            assert got["status"] == "failed" and got["error"]["message"].startswith(message), got
            return
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and error["message"].startswith(message), r.text


class DeletedFileEngine(ParsingEngine):
    """Fails a chat whose file part names an id in ``gone`` as the planner does for an upload since
    deleted: a media error named by the part (its ``loc``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gone: set[str] = set()

    def generate(self, messages, params, **kw):
        for ref in parse_messages(messages).media:
            if ref.file_id in self.gone:
                raise MediaNotFound(f"{ref.loc}: no uploaded file with id {ref.file_id!r}", loc=ref.loc)
        return self.inner.generate(messages, params, **kw)


def test_a_file_of_the_stored_conversation_since_deleted_is_named_by_previous_response_id(tmp_path):
    """The stored conversation is not the request's input: a part of it that fails now is the
    request's previous_response_id, not a chat message the client never sent; a part of the new
    input is still its input item."""
    engine = DeletedFileEngine()
    with ServerThread(create_app(engine, ServerSettings(files_dir=str(tmp_path)))) as server:
        post = lambda body: httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)  # noqa: E731
        look = lambda file_id: [{"role": "user", "content": [  # noqa: E731
            {"type": "input_text", "text": "Look:"}, {"type": "input_file", "file_id": file_id}]}]
        first = post({"input": look("file-old"), "instructions": "Be brief."}).json()
        engine.gone.add("file-old")
        r = post({"input": "And now?", "previous_response_id": first["id"], "instructions": "Be brief."})
        error = r.json()["error"]
        assert r.status_code == 404 and error["param"] == "previous_response_id", r.text
        assert error["message"] == "previous_response_id: no uploaded file with id 'file-old'", r.text
        engine.gone.add("file-new")
        r = post({"input": look("file-new"), "previous_response_id": first["id"]})
        assert r.json()["error"]["param"] == "previous_response_id"  # the stored one fails first
        engine.gone.discard("file-old")
        r = post({"input": look("file-new"), "previous_response_id": first["id"]})
        assert r.json()["error"]["param"] == "input.0.content.1", r.text


def test_the_chat_route_names_a_refused_part_in_param(tmp_path):
    """/v1/chat/completions: the parser's error names the part in ``param`` too, dotted as a
    validation error's."""
    with ServerThread(create_app(ParsingEngine(), ServerSettings(files_dir=str(tmp_path)))) as server:
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={"messages": [
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://host/a.png"}}]}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.1.content.0.image_url.url", r.text
    assert error["message"].startswith("messages[1].content[0].image_url.url: unsupported URL")
