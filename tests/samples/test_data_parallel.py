"""Data-parallel demo training: two CPU processes must train exactly one model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from samples.training.data_parallel import DataParallel, rendezvous_file

from tests.support.paths import REPO as ROOT  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int | None) -> torch.Tensor:
    # The last layer is used by rank 0 only: an unused parameter must still reduce as zero.
    h = model[2](model[1](model[0](x)))
    loss = torch.nn.functional.cross_entropy(h, y)
    return loss + (model[3](h).sum() * 0.1 if rank in (0, None) else 0.0)


def _rank_main(rank: int, rendezvous: str, out: str) -> None:
    dp = DataParallel(rank, 2, rendezvous)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = _data()
    grads = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        _loss(model, x[rank::2], y[rank::2], rank).backward()
        dp.average_gradients(model.parameters())
        if step == 0:
            grads = [p.grad.tolist() for p in model.parameters()]
        opt.step()
    agreed = dp.agree(100.0 + rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "grads": grads, "params": [p.tolist() for p in model.parameters()], "agreed": agreed}))
    dp.exit_worker()


def test_two_ranks_average_gradients_and_stay_identical(tmp_path):
    with rendezvous_file() as rendezvous:
        mp.spawn(_rank_main, args=(rendezvous, str(tmp_path)), nprocs=2, join=True)
    assert not Path(rendezvous).parent.exists()  # no rendezvous directory left behind in /tmp
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["params"] == r1["params"]          # the replicas never drift
    assert r0["agreed"] == r1["agreed"] == 100.0  # rank 0's clock on both
    # The averaged gradient is the mean of the two ranks' own gradients.
    model, (x, y) = _model(), _data()
    want = []
    for rank in (0, 1):
        model.zero_grad()
        _loss(model, x[rank::2], y[rank::2], rank).backward()
        want.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
    for got, a, b in zip(r0["grads"], *want):
        torch.testing.assert_close(torch.tensor(got), (a + b) / 2)


def test_single_process_is_a_no_op_and_bad_ranks_are_named():
    dp = DataParallel()
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    dp.average_gradients([p])
    assert p.grad.tolist() == [3.0, 3.0] and dp.agree(4.5) == 4.5 and dp.is_main
    with pytest.raises(ValueError, match="rank"):
        DataParallel(2, 2, "/tmp/x")
    with pytest.raises(ValueError, match="rendezvous"):
        DataParallel(0, 2)


def test_train_with_two_processes_writes_a_servable_checkpoint(tmp_path):
    """The real script, two ranks, a handful of items: tower phase + joint steps, rank 0 exports."""
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "samples.training.train", "--out", str(out), "--cache", str(tmp_path / "cache"),
           "--procs", "2", "--threads", "1", "--workers", "1", "--steps", "3", "--tower-steps", "2",
           "--token-budget", "1200", "--images", "4", "--audios", "3", "--short-videos", "3", "--long-videos", "0",
           "--modality-weights", "video=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tower phase: 2 steps" in run.stdout and "done: 3 steps" in run.stdout
    assert run.stdout.count("done:") == 1  # rank 1 stays quiet
    info = json.loads((out / "config.json").read_text())["demo_training"]
    assert info["procs"] == 2 and info["steps"] == 3 and info["modality_weights"] == {"video": 2.0}

    from mm_pipeline.model.omni_model import OmniModel

    OmniModel.load(out)  # loads as a serving checkpoint
