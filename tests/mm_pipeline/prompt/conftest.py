"""The demo checkpoint's tokenizer, special tokens and a ChatLayout over them, for the prompt tests."""

from __future__ import annotations

import pytest

from llm_core.llm import load_tokenizer
from mm_pipeline.model.config import OmniConfig
from mm_pipeline.prompt.layout import ChatLayout
from tests.support.paths import DEMO_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


@pytest.fixture(scope="module")
def special():
    return OmniConfig.from_pretrained(DEMO_MODEL).special


@pytest.fixture()
def layout(tokenizer, special):
    return ChatLayout(special, tokenizer)
