"""How a tensor / expert-parallel engine fails (docs/parallelism.md §5): a rank that cannot load, dies
before the rendezvous, or raises in the middle of a call ends the engine quickly with a RankFailure
naming it, and close() never waits on ranks that are out of step. Two CPU ranks over gloo; small
``distributed_timeout_s`` so that a regression shows as a failed time bound, not a hung run.

Faults: a checkpoint whose expert 0 (rank 0's under ep = 2) or expert 7 (rank 1's) has the wrong
shape fails to load on that rank only; rank 1 fails mid-call when rank 0 asks it for more logits rows
than its last forward had; rank 0 fails mid-forward through a patched MLP of its own shard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_core import LLM, SamplingParams
from llm_core.distributed.rank_failure import RankFailure
from llm_core.distributed.rank_group import LaunchSpec, RankGroup, free_port
from llm_core.engine.model_runner import StepResult, run_isolated
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# distributed_timeout_s: what the old code waited before failing. It also bounds a spawned rank's
# start (imports) on this shared 2-core machine, so it cannot be much smaller.
TIMEOUT_S = 30.0
QUICK_S = 8.0  # a failure must be reported (and close() finish) well within that
ENGINE = dict(num_full_tokens=1024, num_swa_tokens=512, distributed_timeout_s=TIMEOUT_S)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _narrow_expert(src: Path, dst: Path, expert: int) -> Path:
    """A copy of ``src`` whose expert ``expert`` has a column too few: only its rank fails to load."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            dst.joinpath(f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    name = f"model.layers.1.mlp.experts.{expert}.down_proj.weight"
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _run_script(args: list[str], script: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """Run a test script (directly or under torchrun); when it hangs -- the old code's deadlock --
    kill every process running it (torchrun starts its ranks in sessions of their own) and fail."""
    try:
        return subprocess.run([*args, str(script)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(script) in proc.joinpath("cmdline").read_text():
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile, or not ours to read
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"hung for {timeout_s:g} s: {err[-2000:]}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    hf = build_tiny_hf_checkpoint(root / "hf", seed=7)
    return {"hf": hf, "bad_rank0": _narrow_expert(hf, root / "bad0", 0),
            "bad_rank1": _narrow_expert(hf, root / "bad1", 7)}


RANK0_LOAD_FAILS = """
import sys, time, multiprocessing, torch
torch.set_num_threads(1)
from llm_core import LLM
start = time.monotonic()
try:
    LLM("CKPT", expert_parallel_size=2, num_full_tokens=1024, num_swa_tokens=512, distributed_timeout_s=60)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc, flush=True)
print("SECONDS", time.monotonic() - start, "CHILDREN", len(multiprocessing.active_children()), flush=True)
"""


def test_rank0_load_failure_ends_the_group(checkpoints, tmp_path):
    """Rank 0 cannot load its shard: its own error is raised at once and rank 1 is terminated (the
    old code broadcast a StopOp at rank 1 waiting in the ready barrier: both hung for good, hence a
    subprocess with a time limit)."""
    script = tmp_path / "run.py"
    script.write_text(RANK0_LOAD_FAILS.replace("CKPT", str(checkpoints["bad_rank0"])))
    run = _run_script([sys.executable], script, 120)
    assert "RAISED ValueError model.layers.1.mlp.experts.0.down_proj.weight: shape" in run.stdout, run.stderr[-3000:]
    seconds = float(run.stdout.split("SECONDS ")[1].split()[0])
    assert seconds < 45 and run.stdout.rstrip().endswith("CHILDREN 0")


TORCHRUN_RANK0_FAILS = """
import os, sys, time, torch
torch.set_num_threads(1)
from llm_core import LLM
try:
    LLM("CKPT", expert_parallel_size=2, num_full_tokens=1024, num_swa_tokens=512, distributed_timeout_s=60)
except Exception as exc:
    print("RANK", os.environ["RANK"], "RAISED", type(exc).__name__, flush=True)
    time.sleep(5)  # rank 1 acts on the handshake before torchrun's agent tears the job down
    sys.exit(3)
"""


def test_rank0_load_failure_under_torchrun_tells_the_other_rank(checkpoints, tmp_path):
    """Under torchrun rank 0 cannot terminate rank 1: the ready handshake tells it, and it exits."""
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_RANK0_FAILS.replace("CKPT", str(checkpoints["bad_rank0"])))
    run = _run_script([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                       str(free_port())], script, 150)
    assert "RANK 0 RAISED ValueError" in run.stdout, run.stderr[-3000:]
    assert "leaving: another rank failed to load (rank 0: ValueError: model.layers.1.mlp.experts.0" in run.stderr
    assert "RANK 1" not in run.stdout  # rank 1 never returned from LLM(...)
    assert "exitcode  : 1 " in run.stderr  # rank 1 exited on its own, before the agent stopped the job


def test_a_rank_that_fails_to_load_is_named_with_its_error(checkpoints):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 failed to load its shard: ValueError: "
                                          r"model\.layers\.1\.mlp\.experts\.7\.down_proj\.weight: shape"):
        LLM(checkpoints["bad_rank1"], expert_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 45
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_before_the_rendezvous_is_named():
    """Rank 1 fails before it joins (here: torch.set_num_threads(0)); rank 0 stops waiting for it
    (the old code waited out the timeout, then raised a store timeout naming no rank)."""
    spec = LaunchSpec(model_dir="unused", device="cpu", dtype="float32", tp_size=2, ep_size=1,
                      init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=60.0, threads=0)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code 1 before joining the group"):
        RankGroup.start(spec)
    assert time.monotonic() - start < 45
    assert not torch.distributed.is_initialized()


def test_a_worker_error_mid_call_ends_the_engine_quickly(checkpoints, capfd):
    """Rank 1 raises inside a call (rank 0 asks for logits of more rows than the last forward had):
    it logs the error with its traceback and exits 1, and rank 0, waiting in the logits all-gather,
    raises RankFailure naming it at once (the old worker swallowed the error and rank 0 waited the
    whole timeout for "a rank stopped answering")."""
    llm = LLM(checkpoints["hf"], tensor_parallel_size=2, **ENGINE)
    try:
        llm.generate([[5, 6, 7, 8]], GREEDY)
        model = llm.engine.runner.model
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code 1 during logits"):
            model.compute_logits(torch.zeros(50, llm.engine.model_config.hidden_size))
        assert time.monotonic() - start < QUICK_S
        with pytest.raises(RankFailure):
            llm.generate([[5, 6, 7]], GREEDY)
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < QUICK_S
    err = capfd.readouterr().err
    assert "mmserve rank 1 ERROR LogitsOp failed" in err  # logged by rank 1, with the traceback
    assert "RuntimeError: rank 1: 1 logits rows, rank 0 asked 50" in err


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_rank0_error_mid_forward_breaks_the_group(checkpoints, error):
    """Rank 0 raises after some of a forward's all-reduces (an OOM, or Ctrl-C): rank 1 is left inside
    that forward, so the error is not one request's -- generate raises (RankFailure; Ctrl-C stays a
    KeyboardInterrupt), the group is not used again and close() terminates rank 1 at once (the old
    code retried the requests on ranks out of step, and its close() waited out the timeout)."""
    llm = LLM(checkpoints["hf"], tensor_parallel_size=2, **ENGINE)
    try:
        mlp = llm.engine.runner.model.local.model.layers[1].mlp

        def fail(*args, **kwargs):
            del mlp.forward  # once
            raise error("injected on rank 0")

        mlp.forward = fail
        expected = RankFailure if error is RuntimeError else error
        with pytest.raises(expected, match="rank 0 failed during forward" if error is RuntimeError else None):
            llm.generate([list(range(5, 30)), list(range(40, 52))], GREEDY)
        with pytest.raises(RankFailure, match="out of step since"):
            llm.engine.check_health()
        start = time.monotonic()
        with pytest.raises(RankFailure, match="out of step since"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - start < QUICK_S
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < QUICK_S


class _UncoveredSource:
    """An EmbeddingSource that covers no position: the prompt's ids reach the model unchecked by
    the engine's admission (which trusts placeholder ids to a source)."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def ready_until(self) -> int:
        return self.prompt_len

    def rows(self, start: int, end: int):
        return torch.zeros(end - start, dtype=torch.bool), torch.zeros(0, 1)


def test_bad_input_fails_its_request_and_workers_take_rank0_settings(checkpoints):
    """A token id outside the vocabulary is caught before any rank starts the call: only its request
    fails and the group stays usable. The other rank runs with rank 0's native_cpu_kernels and the
    same kernel layouts (the old worker kept the C kernels on and never re-laid its weights)."""
    with LLM(checkpoints["hf"], expert_parallel_size=2, native_cpu_kernels=False, **ENGINE) as llm:
        engine = llm.engine
        engine.add_request("bad", [5, 6, 100_000, 7], GREEDY, embeds=_UncoveredSource(4))
        engine.add_request("good", [5, 6, 9, 7], GREEDY)
        done = {}
        while len(done) < 2:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["bad"].finish_reason == "error" and "outside the vocabulary" in done["bad"].error
        assert done["good"].finish_reason != "error" and len(done["good"].token_ids) == 3
        engine.check_health()
        reports = engine.runner.model.reports(engine.pool)
    assert [r["native_cpu_kernels"] for r in reports] == [False, False]
    assert reports[0]["relaid_weights"] == reports[1]["relaid_weights"] > 0


class _Stepper:
    """run_isolated's view of a runner: the step raises an ordinary error; entry probes as given."""

    def __init__(self, probe_errors: dict[int, Exception], rerun_error: Exception | None = None) -> None:
        self.probe_errors, self.rerun_error, self.runs = probe_errors, rerun_error, 0

    def run(self, entries, kv) -> StepResult:
        self.runs += 1
        if self.runs == 1:
            raise ValueError("the step failed")
        if self.rerun_error is not None:
            raise self.rerun_error
        return StepResult([], [])

    def forward(self, entries, kv) -> None:
        if entries[0] in self.probe_errors:
            raise self.probe_errors[entries[0]]


def test_run_isolated_never_makes_a_rank_failure_a_request_error():
    with pytest.raises(RankFailure, match="gone during the probes"):
        run_isolated(_Stepper({1: RankFailure("gone during the probes")}), [0, 1], lambda: None)
    with pytest.raises(RankFailure, match="gone during the rerun"):
        run_isolated(_Stepper({0: ValueError("bad")}, RankFailure("gone during the rerun")), [0, 1], lambda: None)
    result = run_isolated(_Stepper({0: ValueError("bad")}), [0, 1], lambda: None)
    assert [(e, str(exc)) for e, exc in result.failed] == [(0, "bad")]
