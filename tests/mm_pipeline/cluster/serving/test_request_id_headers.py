"""``X-Request-Id`` under ``serve --ray`` (mm_pipeline/cluster/serving/request_id_headers.py) as one
process answers it: the ingress's app (``serve_app.ingress_app``) behind the middleware stack of Ray
Serve's proxy -- Ray's own ``RequestIdMiddleware`` and, wrapped outside it, what our proxy callback
returns, applied as the proxy applies them. A scripted engine (no model, no cluster).

Ray's middleware alone sets a generated ``x-request-id`` on every request and appends its id to every
answer: the ingress took the generated id for the client's (over the body's ``request_id``), answers
carried two ids, and an invalid client id was echoed."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("ray")

from mm_pipeline.errors import ContextLengthError  # noqa: E402
from mm_pipeline.server.settings import ServerSettings  # noqa: E402
from tests.mm_pipeline.server.test_error_statuses import ScriptedEngine  # noqa: E402

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def client(tmp_path):
    """The proxy's stack over the ingress's app; the lifespan goes to the app (a proxy has its own)."""
    from ray.serve._private.http_util import _apply_middlewares

    from mm_pipeline.cluster.serving import request_id_headers
    from mm_pipeline.cluster.serving.serve_app import ingress_app

    engine = ScriptedEngine()
    app = ingress_app(engine, ServerSettings(files_dir=str(tmp_path), model_name="scripted"))
    env = request_id_headers.proxy_env()
    module, name = env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].rsplit(".", 1)
    assert module == request_id_headers.__name__
    proxy = _apply_middlewares(app, getattr(request_id_headers, name)())

    async def stack(scope: dict, receive: Any, send: Any) -> None:
        await (app if scope["type"] == "lifespan" else proxy)(scope, receive, send)

    with TestClient(stack, raise_server_exceptions=False) as c:
        c.engine = engine
        yield c


def one_id(r) -> str:
    ids = r.headers.get_list("x-request-id")
    assert len(ids) == 1, ids
    return ids[0]


def test_one_id_per_answer_and_a_fresh_one_without_a_client_id(client):
    first, second = one_id(client.get("/v1/models")), one_id(client.get("/health"))
    assert first != second and re.fullmatch(r"[0-9a-f]{32}", first)  # ours (uuid4 hex), not Ray's uuid
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and one_id(r) == r.json()["id"] and re.fullmatch(r"chatcmpl-[0-9a-f]+", one_id(r))


def test_the_clients_header_or_body_id_is_honoured(client):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-1"})
    assert one_id(r) == r.json()["id"] == "chatcmpl-trace-1"
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert one_id(r) == r.json()["id"] == "chatcmpl-from-body"
    client.engine.raises = ContextLengthError("too long")
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert r.status_code == 400 and one_id(r) == "from-body"
    assert one_id(client.get("/v1/models", headers={"X-Request-Id": "trace-2"})) == "trace-2"


def test_an_invalid_client_id_is_refused_and_not_echoed(client):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "has space"})
    assert r.status_code == 400 and "X-Request-Id must be" in r.json()["error"]["message"]
    assert one_id(r) != "has space"
    assert one_id(client.get("/v1/models", headers={"X-Request-Id": "x" * 200})) != "x" * 200


def test_the_proxys_own_headers_cannot_be_forged(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"},
                    headers={"x-mmserve-proxied": "1", "x-mmserve-client-request-id": "forged"})
    assert one_id(r) == "chatcmpl-from-body"


def test_the_proxy_module_imports_neither_torch_nor_the_server_app():
    """Ray Serve's proxies import this module at their start (the proxy callback). It imported the
    whole server (torch, the engine): ~4 s of a proxy's start on an idle box, and on a busy one past
    Serve's three 5 s readiness checks, after which the controller killed the proxy and ``serve
    --ray`` failed to start (seen in CI)."""
    import subprocess
    import sys

    code = ("import sys, mm_pipeline.cluster.serving.request_id_headers as m; m.proxy_middlewares(); "
            "print(sorted(n for n in ('torch', 'mm_pipeline.server.app', 'llm_core') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
