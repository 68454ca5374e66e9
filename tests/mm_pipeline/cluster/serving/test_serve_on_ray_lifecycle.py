"""``mmserve serve --ray ADDRESS`` (mm_pipeline/cluster/ray_commands.py) from start to stop, with
stand-ins for joining the cluster and for Serve's start and stop: a Ctrl-C or SIGTERM while the app
deploys deletes it (it was left deploying on the cluster), with SIGTERM's handler in place from
before the deploy; an app Serve refused to run is not deleted (one of that name there is not ours);
a Ctrl-C or SIGTERM while serving deletes the app and exits 0, as one process does after its drain
(it was 130). And ``--enable-log-requests`` reaches the ingress replica, which serves the requests."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import SimpleNamespace

import pytest

from mm_pipeline.cli import UsageError, parse_args
from tests.support.serve_broadcast import Broadcast

pytest.importorskip("ray")


@pytest.fixture
def serve_stubs(monkeypatch):
    """The calls serve_on_ray makes, recorded; ``behaviour["start"]`` is what start() does."""
    import mm_pipeline.cluster.ray_runtime as ray_runtime
    import mm_pipeline.cluster.serving.serve_app as serve_app

    calls: list[str] = []
    behaviour = {}

    def start(model_dir, config, settings, cluster):
        calls.append(f"start (SIGTERM raises: {signal.getsignal(signal.SIGTERM) is signal.default_int_handler})")
        behaviour["start"]()

    def connect(cfg):  # ray.init installs its core worker's own SIGTERM handler
        calls.append("connect")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    monkeypatch.setattr(ray_runtime, "connect", connect)
    monkeypatch.setattr(serve_app, "start", start)
    monkeypatch.setattr(serve_app, "stop", lambda cluster: calls.append(f"stop {cluster.app_name}"))
    before = signal.getsignal(signal.SIGTERM)
    yield calls, behaviour
    signal.signal(signal.SIGTERM, before)


def serve_args():
    return parse_args(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379"])


def test_an_interrupt_while_the_app_deploys_deletes_it(serve_stubs):
    from mm_pipeline.cluster.ray_commands import serve_on_ray

    calls, behaviour = serve_stubs

    def interrupted():
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM through its handler, inside serve.run

    behaviour["start"] = interrupted
    with pytest.raises(KeyboardInterrupt):
        serve_on_ray(serve_args())
    assert calls == ["connect", "start (SIGTERM raises: True)", "stop mmserve"]


def test_an_app_serve_refused_to_run_is_not_deleted(serve_stubs):
    from mm_pipeline.cluster.ray_commands import serve_on_ray

    calls, behaviour = serve_stubs

    def refused():
        raise ValueError("Ray Serve is already running with other HTTP options (ssl_keyfile)")

    behaviour["start"] = refused
    with pytest.raises(UsageError, match="already running"):
        serve_on_ray(serve_args())
    assert calls == ["connect", "start (SIGTERM raises: True)"]


def test_an_interrupt_while_serving_deletes_the_app_and_exits_0(serve_stubs, monkeypatch):
    from mm_pipeline.cli import main

    calls, behaviour = serve_stubs
    behaviour["start"] = lambda: None

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM through its handler, while the driver waits

    monkeypatch.setattr(time, "sleep", interrupted)
    assert main(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379"]) == 0
    assert calls == ["connect", "start (SIGTERM raises: True)", "stop mmserve"]


class StatsHandle:
    """The LLM deployment as the ingress's constructor asks it: one routed stats call (a replica is
    up), then the stats broadcast to every replica (one here)."""

    @property
    def stats(self) -> "StatsHandle":
        return self

    def remote(self) -> object:
        async def snapshot() -> object:
            return SimpleNamespace()
        return snapshot()

    def broadcast(self, method: str) -> Broadcast:
        return Broadcast([("replica-a", SimpleNamespace())])


@pytest.mark.parametrize("on", [True, False])
def test_the_ingress_replica_logs_requests_when_asked(on, capsys):
    """``serve`` raised the logger to INFO only in the driver: under --ray nothing was written."""
    from mm_pipeline.cluster.serving.serve_app import ServeClusterConfig, build_app
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.server.settings import ServerSettings
    from tests.support.paths import DEMO_MODEL

    logger = logging.getLogger("mmserve.requests")
    before = logger.level, list(logger.handlers), logger.propagate
    logger.setLevel(logging.NOTSET)
    logger.handlers.clear()
    try:
        app = build_app(DEMO_MODEL, OmniEngineConfig.from_kwargs(device="cpu"), ServerSettings(log_requests=on),
                        ServeClusterConfig())
        ingress = app._bound_deployment.func_or_class.__mro__[1]  # ours, under Serve's ASGI wrapper
        asyncio.run(ingress.__init__(SimpleNamespace(), StatsHandle()))  # what the replica runs on start
        logger.info("chatcmpl-x: finished")
        assert ("mmserve.requests: chatcmpl-x: finished" in capsys.readouterr().err) is on
    finally:
        logger.handlers[:] = before[1]
        logger.propagate = before[2]
        logger.setLevel(before[0])
