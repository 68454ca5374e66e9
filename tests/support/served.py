"""A tiny random omni checkpoint served over HTTP on 127.0.0.1, for server tests that need a real
engine (``with served_tiny_omni(tmp_path_factory, max_num_seqs=1) as server: ...``)."""

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
