"""Auth and hygiene (issue 22, rows 3, 10-13): what an unauthenticated or hostile client can reach,
what it can make the server keep, log and say.

A scripted engine (no model) stands behind the app: every check here is about the HTTP layer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import string

import pytest
from fastapi.testclient import TestClient

from mm_pipeline.errors import OverloadedError, UndecodableMediaError
from mm_pipeline.server import ServerSettings, create_app

from tests.mm_pipeline.server.test_error_statuses import CHAT, ScriptedEngine

KEY = "sk-hygiene"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture()
def keyed(tmp_path):
    engine = ScriptedEngine()
    app = create_app(engine, ServerSettings(api_key=KEY, files_dir=str(tmp_path)))
    with TestClient(app, raise_server_exceptions=False) as client:
        client.engine = engine
        yield client


@pytest.fixture()
def open_server(tmp_path):
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerSettings(files_dir=str(tmp_path))), raise_server_exceptions=False) as c:
        c.engine = engine
        yield c


# ---- row 13: what the key protects ---------------------------------------------------------------
@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models", "/v1/files"])
def test_everything_but_health_and_the_page_needs_the_key(keyed, path):
    r = keyed.get(path)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    assert keyed.get(path, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/", "/web/app.js"])
def test_health_and_the_upload_page_stay_open(keyed, path):
    assert keyed.get(path).status_code == 200


def test_behind_a_root_path_the_same_routes_are_open_and_keyed(tmp_path):
    """--root-path: uvicorn and Ray's proxy keep the prefix in the request's path; the open routes
    (a liveness probe, the page) stay open under it and the rest still needs the key."""
    app = create_app(ScriptedEngine(), ServerSettings(api_key=KEY, files_dir=str(tmp_path)))
    with TestClient(app, root_path="/mmserve", raise_server_exceptions=False) as client:
        for path in ("/health", "/", "/web/app.js"):
            assert client.get(path).status_code == 200, path
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        # a path that only starts with the prefix's letters is not under it
        assert client.get("/mmserveX/health").status_code in (401, 404)
        # the page's own URLs are relative: behind the proxy they resolve under its prefix
        page, api = client.get("/").text, client.get("/web/api.js").text
        assert 'href="/' not in page and 'src="/' not in page
        assert '"/v1/' not in api and '`/v1/' not in api and '"v1/chat/completions"' in api


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xe9", "Bearer sk-hygi\u00e9ne".encode("utf-8"), b"Bearer",
                                   b"Basic " + KEY.encode(), f"Bearer {KEY}x".encode()])
def test_a_wrong_or_non_ascii_bearer_token_is_401(keyed, value):
    assert keyed.get("/v1/models", headers={"Authorization": value}).status_code == 401


# ---- row 10: metric labels -----------------------------------------------------------------------
def test_made_up_paths_do_not_grow_the_metrics(keyed):
    """401s and 404s are counted by route template (or "other"), never by the raw path."""
    rng = random.Random(0)

    def junk() -> str:
        return "/" + "/".join("".join(rng.choices(string.ascii_letters, k=8)) for _ in range(rng.randint(1, 3)))

    for _ in range(50):  # every label the junk can produce exists after these
        keyed.get(junk())
        keyed.get("/v1" + junk())
        keyed.get(junk(), headers=AUTH)
        keyed.get("/v1/files/" + junk()[1:], headers=AUTH)
    before = len(keyed.get("/metrics", headers=AUTH).text)
    for _ in range(1000):
        keyed.get(junk())
        keyed.get("/v1" + junk())
        keyed.get(junk(), headers=AUTH)
        keyed.get("/v1/files/" + junk()[1:], headers=AUTH)
    text = keyed.get("/metrics", headers=AUTH).text
    assert len(text) - before < 200  # counter values grow by a few digits; no new series
    assert 'endpoint="other",status="401"' in text and 'endpoint="/v1/files/{file_id}",status="404"' in text


# ---- row 11: one log line per rejection ----------------------------------------------------------
def _server_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mmserve.server"]


def test_a_rejected_request_is_one_log_line_without_a_traceback(open_server, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.server")
    open_server.engine.raises = OverloadedError("12 requests in flight")
    for _ in range(5):
        assert open_server.post("/v1/chat/completions", json=CHAT).status_code == 429
    records = _server_records(caplog)
    assert len(records) == 5 and not any(r.exc_info for r in records)
    assert "429" in records[0].getMessage() and "/v1/chat/completions" in records[0].getMessage()
    caplog.clear()
    assert open_server.post("/v1/chat/completions", json={"messages": "x"}).status_code == 400
    assert len(_server_records(caplog)) == 1


def test_a_bug_is_one_traceback_and_a_500(open_server, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.server")
    open_server.engine.raises = RuntimeError("secret internals at 0xdeadbeef")
    r = open_server.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and "secret" not in r.text
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1
    assert open_server.get("/health").status_code == 200


# ---- row 13: messages without internals ----------------------------------------------------------
def test_error_messages_name_the_problem_without_internals(open_server, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.server")
    cause = OSError("cannot identify image file <_io.BytesIO object at 0x7f3a2c1b9e40>")
    try:
        raise UndecodableMediaError(f"png image from upload is damaged ({cause})") from cause
    except UndecodableMediaError as exc:
        open_server.engine.raises = exc
    r = open_server.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "png image from upload is damaged"
    assert "0x7f3a2c1b9e40" in caplog.text  # the detail is kept for the operator


# ---- row 3: every sampling field bounded at the API ----------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 1e30), ("top_k", 2**31), ("top_k", -2), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("n", 17), ("n", 0),
    ("max_tokens", 0), ("max_tokens", 2**31), ("logprobs", True), ("top_logprobs", 21),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", "x" * 257), ("stop", [""]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]), ("stop_token_ids", list(range(65))),
])
def test_out_of_range_sampling_fields_are_400_naming_the_field(open_server, field, value):
    body = {**CHAT, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "logprobs":  # completions take an int: a bool is not a count there
        body = {"prompt": [1, 2], "logprobs": 99}
        r = open_server.post("/v1/completions", json=body)
    else:
        r = open_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, (field, value, r.text)
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field


def test_a_seed_at_the_top_of_its_range_with_n_choices_is_served(open_server):
    """seed + choice wraps inside the engine's range instead of failing choice 1."""
    open_server.engine.raises = None
    r = open_server.post("/v1/chat/completions", json={**CHAT, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_a_client_gone_while_its_body_is_read_is_not_an_error(open_server, caplog):
    """Starlette raises ClientDisconnect from the body stream: no 500, no traceback."""
    app = open_server.app
    sent: list[dict] = []
    messages = iter([{"type": "http.request", "body": b'{"messages": [', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    caplog.set_level(logging.INFO)
    asyncio.run(app(scope, receive, send))
    assert not [m for m in sent if m["type"] == "http.response.start" and m["status"] >= 500]
    assert not [r for r in caplog.records if r.exc_info]


def test_a_big_body_is_parsed_off_the_event_loop_without_a_copy_on_it(open_server, monkeypatch):
    """A body of megabytes of base64 media is parsed on a worker thread, and the receive buffer goes
    there as it is: ``bytes(buffer)`` on the loop was a copy of the whole body (~65 ms at 160 MB).
    A small body is parsed on the loop, where nothing hands the GIL away."""
    import threading

    from mm_pipeline.server import request_body

    seen = []
    off_loop, parse = request_body._validate_off_loop, request_body._validate
    monkeypatch.setattr(request_body, "_validate_off_loop", lambda model, raw, *rest: seen.append(
        ("off", threading.get_ident(), type(raw))) or off_loop(model, raw, *rest))
    monkeypatch.setattr(request_body, "_validate", lambda model, raw, *rest: seen.append(
        ("parse", threading.get_ident(), type(raw))) or parse(model, raw, *rest))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (request_body._INLINE_PARSE_BYTES + 1)}]}
    assert open_server.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert open_server.post("/v1/chat/completions", json=big).status_code == 200
    (small, loop_thread, small_type), (off, off_thread, buffer_type), (parse_big, parse_thread, _) = seen
    assert (small, off, parse_big) == ("parse", "off", "parse") and small_type is bytes
    assert off_thread != loop_thread and parse_thread == off_thread
    assert buffer_type is bytearray  # the receive buffer, not a copy of it made on the loop


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_the_value_bound_is_counted_as_the_body_arrives_whatever_its_pieces(piece):
    """The JSON value bound is counted chunk by chunk once the body is longer than the cap (each value
    takes a byte): the same answer for any chunking -- a body of cap + 1 values is refused with the
    count, one of cap values is parsed -- and a refused body is not read to its end."""
    import json

    from mm_pipeline.server.errors import APIError
    from mm_pipeline.server.json_limits import JSONLimits
    from mm_pipeline.server.protocol import CompletionRequest
    from mm_pipeline.server.request_body import parse_body

    cap = 40

    class Arriving:
        headers: dict = {}

        def __init__(self, body: bytes) -> None:
            self.body, self.sent = body, 0

        async def stream(self):
            for start in range(0, len(self.body), piece):
                self.sent = start + piece
                yield self.body[start:start + piece]

    def body(ids: int) -> bytes:  # 1 object + its 3 members + the ids: a bound of ids + 3
        return json.dumps({"model": "m", "prompt": list(range(ids)), "max_tokens": 1}).encode()

    fits = Arriving(body(cap - 3))
    limits = JSONLimits(1 << 20, cap)
    assert asyncio.run(parse_body(fits, CompletionRequest, limits)).prompt == list(range(cap - 3))
    over = Arriving(body(cap - 2) + b" " * 4096)
    with pytest.raises(APIError, match=f"up to {cap + 1} JSON values"):
        asyncio.run(parse_body(over, CompletionRequest, limits))
    assert piece >= len(over.body) or over.sent < len(over.body)


def test_the_key_comes_from_the_environment_when_no_flag_gives_it(tmp_path, monkeypatch):
    """MMSERVE_API_KEY (vLLM reads VLLM_API_KEY alike): a flag's value shows in ps to every user."""
    from mm_pipeline import cli
    from mm_pipeline.server.launch.serve_settings import server_settings
    monkeypatch.setenv("MMSERVE_API_KEY", KEY)
    assert server_settings(cli.parse_args(["serve", "--model", "m"]), tmp_path).api_key == KEY
    assert server_settings(cli.parse_args(["serve", "--model", "m", "--api-key", "sk-flag"]), tmp_path).api_key \
        == "sk-flag"  # the flag wins
    monkeypatch.setenv("MMSERVE_API_KEY", "")
    assert server_settings(cli.parse_args(["serve", "--model", "m"]), tmp_path).api_key is None


def test_several_served_model_names(tmp_path, capsys):
    """vLLM's --served-model-name a b: requests may name either, answers and the first card carry
    the first, /v1/models lists both; another name is still a 404. From the CLI and a --config list."""
    from mm_pipeline import cli
    from mm_pipeline.server.launch.serve_settings import server_settings

    args = cli.parse_args(["serve", "--model", "m", "--served-model-name", "mimo", "mimo-v2.5-omni"])
    settings = server_settings(args, tmp_path)
    assert (settings.model_name, settings.model_aliases) == ("mimo", ("mimo-v2.5-omni",))
    (tmp_path / "serve.yaml").write_text("served_model_name: [a, b]\n")
    args = cli.parse_args(["serve", "--model", "m", "--config", str(tmp_path / "serve.yaml")])
    assert server_settings(args, tmp_path).model_aliases == ("b",)
    app = create_app(ScriptedEngine(), ServerSettings(model_name="mimo", model_aliases=("mimo-v2.5-omni",),
                                                      files_dir=str(tmp_path)))
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["mimo", "mimo-v2.5-omni"]
        assert client.get("/v1/models/mimo-v2.5-omni").json()["root"] == "mimo"
        for name in ("mimo", "mimo-v2.5-omni"):
            r = client.post("/v1/chat/completions", json={**CHAT, "model": name})
            assert r.status_code == 200 and r.json()["model"] == "mimo", r.text
        unknown = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert unknown.status_code == 404  # naming every name the server answers to
        assert unknown.json()["error"]["message"].endswith("this server serves 'mimo', 'mimo-v2.5-omni'")
