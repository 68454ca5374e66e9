"""The parallel sizes are EngineConfig fields, so they are checked once and reach every front end:
LLM(...) keywords, `mmserve serve --tensor-parallel-size` flags, --config keys."""

from __future__ import annotations

import pytest

from llm_core.engine.engine_config import EngineConfig
from mm_pipeline import cli


def test_parallel_fields_are_validated():
    assert EngineConfig(tensor_parallel_size=8, expert_parallel_size=4).world_size == 8
    assert EngineConfig(expert_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="tp must be 1 or max"):
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="ep must divide"):
        EngineConfig(tensor_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="KV tiers"):
        EngineConfig(tensor_parallel_size=2, kv_host_bytes=1 << 20)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineConfig(distributed_timeout_s=0)


def test_serve_flags_reach_the_engine_config(tmp_path):
    args = cli.parse_args(["serve", "--model", str(tmp_path), "--tensor-parallel-size", "2",
                              "--expert-parallel-size", "2", "--distributed-timeout-s", "30",
                              "--encoder-device", "cpu"])
    cfg = cli.engine_config(args)
    assert (cfg.engine.tensor_parallel_size, cfg.engine.expert_parallel_size) == (2, 2)
    assert cfg.engine.distributed_timeout_s == 30 and cfg.encoder_device == "cpu"
    with pytest.raises(cli.UsageError, match="tp must be 1"):
        cli.engine_config(cli.parse_args(["serve", "--model", str(tmp_path), "--tensor-parallel-size", "2",
                                             "--expert-parallel-size", "4"]))
