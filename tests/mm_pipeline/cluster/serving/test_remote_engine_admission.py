"""``serve --ray``'s ingress refuses a request of more choices than an LLM replica admits
(``--max-queue``) as one process does, 400, before any reaches a replica: ``ChatService`` reads the
slots from the engine's ``config``, which RemoteEngine lacked, so the check was skipped and the
replica answered 429 -- which a /v1/batches line retries forever. A stand-in handle; no cluster."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")  # RemoteEngine names Ray's error types

from mm_pipeline.cluster.serving.remote_engine import RemoteEngine  # noqa: E402
from mm_pipeline.runtime.config import OmniEngineConfig  # noqa: E402


class Handle:
    """The LLM deployment: counts the calls that reached it (none should)."""

    calls = 0

    def options(self, **_: Any) -> "Handle":
        return self

    @property
    def generate(self) -> "Handle":
        return self

    def remote(self, *_: Any, **__: Any) -> Any:
        Handle.calls += 1
        raise AssertionError("a request over --max-queue reached a replica")


def test_more_choices_than_a_replica_admits_is_a_400():
    from fastapi.testclient import TestClient

    from mm_pipeline.server.app import create_app
    from mm_pipeline.server.settings import ServerSettings

    config = OmniEngineConfig.from_kwargs(device="cpu", max_queue=4)
    engine = RemoteEngine(Handle(), None, "m", limits=config.limits, config=config)
    assert engine.config.max_queue == 4
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 5}
    with TestClient(create_app(engine, ServerSettings(model_name="m"))) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2})
        assert r.status_code == 400 and "6 choices" in r.json()["error"]["message"]
    assert Handle.calls == 0
