"""Engines served over HTTP on 127.0.0.1 for the server tests: a tiny random omni checkpoint
(``with served_tiny_omni(tmp_path_factory, max_num_seqs=1) as server: ...``), the demo checkpoint's
engine (``demo_engine_with``) and an httpx client of any engine served in process (``served_client``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.omni_engine import OmniEngine
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
from tests.support.paths import DEMO_MODEL


@contextlib.contextmanager
def served_tiny_omni(tmp_path_factory: pytest.TempPathFactory, settings: dict[str, Any] | None = None,
                     audio_path: str = "ours", **config: Any) -> Iterator[ServerThread]:
    """``config``: flat ``OmniEngineConfig.from_kwargs`` fields; ``settings``: ``ServerSettings``
    fields; ``audio_path``: the checkpoint's audio encoder ("ours" or the MiMo-V2.5 "reference"
    RVQ path). The server thread gets the engine as ``server.engine``; both stop when the block ends."""
    model_dir = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "tiny-omni", seed=0,
                                           audio_path=audio_path)
    engine = OmniEngine.from_pretrained(model_dir, OmniEngineConfig.from_kwargs(**config))
    try:
        server_settings = ServerSettings(files_dir=str(tmp_path_factory.mktemp("files")), **(settings or {}))
        with ServerThread(create_app(engine, server_settings)) as server:
            server.engine = engine
            yield server
    finally:
        engine.shutdown()


def wait_idle(server: ServerThread, seconds: float = 10.0) -> None:
    """Wait until the served engine holds nothing of any request: admission slots, both worker
    pools, the decode budget, encoder units; then check the pools' and the budget's integrity."""
    runtime = server.engine.runtime
    deadline = time.monotonic() + seconds
    while True:
        idle = {"admission": server.engine.requests_in_flight, "media pool": runtime.pool.admitted,
                "text pool": runtime.text_pool.admitted, "decode bytes": runtime.planner.producer.budget.in_use,
                "encoder units": runtime.batcher.stats()["in_flight_units"]}
        if not any(idle.values()):
            break
        assert time.monotonic() < deadline, f"not idle: {idle}"
        time.sleep(0.02)
    runtime.pool.check_integrity()
    runtime.planner.producer.budget.check_integrity()


@contextlib.contextmanager
def served_client(engine: Any, files_dir: str, timeout: float = 120, **settings: Any) -> Iterator[Any]:
    """``create_app(engine, ServerSettings(files_dir=files_dir, **settings))`` in a ServerThread and
    an httpx client of it; both stop when the block ends (the engine is the caller's)."""
    import httpx

    app = create_app(engine, ServerSettings(files_dir=files_dir, **settings))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=timeout) as client:
        yield client


@contextlib.contextmanager
def demo_engine_with(**config: Any) -> Iterator[OmniEngine]:
    """An OmniEngine over the demo checkpoint (4096 Full / 2048 SWA KV tokens unless ``config``
    says otherwise; any OmniEngineConfig keyword), shut down when the block ends."""
    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(
        **{"num_full_tokens": 4096, "num_swa_tokens": 2048, **config}))
    try:
        yield engine
    finally:
        engine.shutdown()
