"""parse_dtype: the one dtype spelling table of the offline LLM, the omni model and the CLI."""

from __future__ import annotations

import pytest
import torch

from llm_core.model.dtype import DTYPE_NAMES, parse_dtype


@pytest.mark.parametrize("spelling,want", [
    ("float32", torch.float32), ("fp32", torch.float32), (torch.float32, torch.float32),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    (" BF16 ", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16), (torch.float16, torch.float16),
])
def test_spellings(spelling, want):
    assert parse_dtype(spelling) is want


@pytest.mark.parametrize("bad", ["float8", "int8", "", torch.int64, torch.float8_e4m3fn, None, 16])
def test_unknown_dtype_names_the_accepted_spellings(bad):
    with pytest.raises(ValueError, match="unknown dtype") as info:
        parse_dtype(bad)
    assert all(name in str(info.value) for name in DTYPE_NAMES)
