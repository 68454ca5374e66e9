"""The demo checkpoint's tokenizer, shared by the server tests that compare ids or script answers, and
the demo checkpoint served in process (one engine per test module that asks for it)."""

from __future__ import annotations

import pytest

from llm_core.llm import load_tokenizer
from tests.support.paths import DEMO_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


@pytest.fixture(scope="module")
def demo_engine():
    """An OmniEngine over the demo checkpoint (4096 Full / 2048 SWA KV tokens), shut down after the module."""
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.runtime.omni_engine import OmniEngine

    engine = OmniEngine.from_pretrained(DEMO_MODEL, OmniEngineConfig.from_kwargs(num_full_tokens=4096,
                                                                                 num_swa_tokens=2048))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def demo_client(demo_engine, tmp_path_factory):
    """An httpx client of the demo checkpoint served in process (default ServerSettings)."""
    import httpx

    from mm_pipeline.server import ServerSettings, ServerThread, create_app

    app = create_app(demo_engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files"))))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=120) as c:
        yield c
