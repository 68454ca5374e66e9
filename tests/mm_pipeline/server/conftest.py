"""The demo checkpoint's tokenizer, shared by the server tests that compare ids or script answers, and
the demo checkpoint served in process (one engine per test module that asks for it); the batch
runner tests' files store (``store``) and the Responses API tests' scripted servers (``scripted``)."""

from __future__ import annotations

import pytest

from llm_core.llm import load_tokenizer
from mm_pipeline.server import ServerSettings, ServerThread, create_app
from mm_pipeline.server.files.files_store import FilesStore
from tests.support.paths import DEMO_MODEL
from tests.support.served import demo_engine_with, served_client


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


@pytest.fixture(scope="module")
def demo_engine():
    """An OmniEngine over the demo checkpoint (4096 Full / 2048 SWA KV tokens), shut down after the module."""
    with demo_engine_with() as engine:
        yield engine


@pytest.fixture(scope="module")
def demo_client(demo_engine, tmp_path_factory):
    """An httpx client of the demo checkpoint served in process (default ServerSettings)."""
    with served_client(demo_engine, str(tmp_path_factory.mktemp("files"))) as c:
        yield c


@pytest.fixture
def store(tmp_path) -> FilesStore:
    """The batch runner tests' files store (test_batch_runner.py, test_batch_validation.py,
    test_batch_expiry.py)."""
    return FilesStore(tmp_path / "files")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """``scripted(scripts)``: the base URL of a server of ``ThinkingEngine_for(scripts)`` (the
    Responses API tests: test_responses_store.py, test_responses_output_items.py,
    test_responses_background.py), each started at the call and stopped after the module.
    test_error_statuses.py has a ``scripted`` of its own."""
    from tests.support.responses_api import ThinkingEngine_for

    servers: list[ServerThread] = []

    def start(scripts: list[list[str]]) -> str:
        settings = ServerSettings(files_dir=str(tmp_path_factory.mktemp("f")))
        server = ServerThread(create_app(ThinkingEngine_for(scripts), settings)).start()
        servers.append(server)
        return server.base_url

    yield start
    for server in servers:
        server.stop()
