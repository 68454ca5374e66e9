"""The demo checkpoint's tokenizer, shared by the server tests that compare ids or script answers, and
the demo checkpoint served in process (one engine per test module that asks for it)."""

from __future__ import annotations

import pytest

from llm_core.llm import load_tokenizer
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
