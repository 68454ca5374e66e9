"""An OmniEngine (or a stand-in with its API) served in process on 127.0.0.1, with an httpx client of it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def served_client(engine: Any, files_dir: str, timeout: float = 120, **settings: Any) -> Iterator[Any]:
    """``create_app(engine, ServerSettings(files_dir=files_dir, **settings))`` in a ServerThread and
    an httpx client of it; both stop when the block ends (the engine is the caller's)."""
    import httpx

    from mm_pipeline.server import ServerSettings, ServerThread, create_app

    app = create_app(engine, ServerSettings(files_dir=files_dir, **settings))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=timeout) as client:
        yield client


@contextmanager
def demo_engine_with(**config: Any) -> Iterator[Any]:
    """An OmniEngine over the demo checkpoint (4096 Full / 2048 SWA KV tokens unless ``config``
    says otherwise; any OmniEngineConfig keyword), shut down when the block ends."""
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from tests.support.paths import DEMO_MODEL

    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(
        **{"num_full_tokens": 4096, "num_swa_tokens": 2048, **config}))
    try:
        yield engine
    finally:
        engine.shutdown()
