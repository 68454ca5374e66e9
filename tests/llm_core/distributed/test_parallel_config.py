"""The parallel sizes are EngineConfig fields, so they are checked once and reach every front end:
LLM(...) keywords, `mmserve serve --tensor-parallel-size` flags, --config keys."""

from __future__ import annotations

import pytest
import torch

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


def test_rank_devices_follow_the_given_gpu_and_torchrun_only(monkeypatch):
    """Rank k's GPU: the k-th from the one given (cuda:4 puts a world of 2 on GPUs 4 and 5); a
    LOCAL_RANK another launcher left in the environment does not pull every spawned rank onto one
    GPU -- only under torchrun is it the rank's GPU; a world past the machine's GPUs is refused
    before anything starts."""
    from llm_core.distributed.launcher import load_text_model
    from llm_core.distributed.rank_group import LaunchSpec

    def spec(device: str) -> LaunchSpec:
        return LaunchSpec(model_dir="m", device=device, dtype="bfloat16", tp_size=2, ep_size=1,
                          init_method="tcp://127.0.0.1:1", timeout_s=5.0, threads=1)

    for var in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert [spec("cuda").device_of(r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [spec("cuda:4").device_of(r) for r in (0, 1)] == [torch.device("cuda", 4), torch.device("cuda", 5)]
    monkeypatch.setenv("LOCAL_RANK", "0")  # e.g. a one-process torchrun or a cluster launcher
    assert [spec("cuda").device_of(r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's own: this process is rank 1 on GPU 1
    assert spec("cuda").device_of(1) == torch.device("cuda", 1)
    assert spec("cpu").device_of(1) == torch.device("cpu")
    for var in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=r"need GPUs 3..4; this machine has 4"):
        load_text_model("unused", device="cuda:3", tensor_parallel_size=2)
