"""CORS (``--allowed-origins``): off by default (no page of another origin may read an answer), the
named origins get the headers browsers need, a preflight is answered before the API key is asked for
(a browser sends none with it), the answer's own headers are readable by the page, and credentials
are refused with origin ``*``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mm_pipeline.server import ServerSettings, create_app
from tests.mm_pipeline.server.test_error_statuses import ScriptedEngine

APP_ORIGIN = "https://app.example.com"
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def client(tmp_path, **settings) -> TestClient:
    return TestClient(create_app(ScriptedEngine(), ServerSettings(files_dir=str(tmp_path), model_name="scripted",
                                                                  **settings)))


def test_no_origin_may_read_answers_by_default(tmp_path):
    with client(tmp_path) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP_ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert "access-control-allow-origin" not in c.options("/v1/chat/completions", headers=PREFLIGHT).headers


def test_a_named_origin_is_allowed_before_the_key_and_reads_the_answer_headers(tmp_path):
    with client(tmp_path, allowed_origins=(APP_ORIGIN,), api_key="sk-1") as c:
        pre = c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP_ORIGIN, "Authorization": "Bearer sk-1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "x-encoder-cache-hits" in exposed
        # the key is still asked for; another origin gets no allowance
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP_ORIGIN}).status_code == 401
        other = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example",
                                                                    "Authorization": "Bearer sk-1"})
        assert "access-control-allow-origin" not in other.headers


def test_any_origin_and_credentials(tmp_path):
    with client(tmp_path, allowed_origins=("*",)) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://anywhere.example"})
        assert r.headers["access-control-allow-origin"] == "*"
    with pytest.raises(ValueError, match="allow_credentials"):
        ServerSettings(allowed_origins=("*",), allow_credentials=True)
    with client(tmp_path, allowed_origins=(APP_ORIGIN,), allow_credentials=True) as c:
        r = c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.headers["access-control-allow-credentials"] == "true"


def test_the_flags(tmp_path):
    from mm_pipeline import cli
    from mm_pipeline.server.launch.serve_settings import server_settings
    args = cli.parse_args(["serve", "--model", "m", "--allowed-origins", APP_ORIGIN, "--allowed-origins",
                           "http://localhost:3000", "--allow-credentials"])
    settings = server_settings(args, tmp_path)
    assert settings.allowed_origins == (APP_ORIGIN, "http://localhost:3000") and settings.allow_credentials
    with pytest.raises(cli.UsageError, match="allow_credentials"):
        server_settings(cli.parse_args(["serve", "--model", "m", "--allowed-origins", "*", "--allow-credentials"]),
                            tmp_path)
