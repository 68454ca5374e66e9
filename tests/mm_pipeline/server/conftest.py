"""The demo checkpoint's tokenizer, shared by the server tests that compare ids or script answers."""

from __future__ import annotations

import pytest

from llm_core.llm import load_tokenizer
from tests.support.paths import DEMO_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)
