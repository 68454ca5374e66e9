"""parse_dtype: the one spelling table for model dtypes (offline LLM, omni model, CLI, configs).

    "float32" | "fp32" | torch.float32    -> torch.float32
    "bfloat16" | "bf16" | torch.bfloat16  -> torch.bfloat16
    "float16" | "fp16" | "half" | torch.float16 -> torch.float16

Only these three floating types: a model computes in one of them (an fp8 checkpoint is dequantised
into it on load, llm_core/model/loader.py), so any other dtype is a mistake worth reporting early.
"""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DTYPE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype named by ``dtype`` (a name above, with or without a ``torch.`` prefix, or a
    torch dtype); ``ValueError`` naming the accepted spellings otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in _BY_NAME.values():
            return dtype
    elif isinstance(dtype, str):
        found = _BY_NAME.get(dtype.strip().lower().removeprefix("torch."))
        if found is not None:
            return found
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)} (or the torch dtype)")
