"""Which input a replica's death is charged to, when Ray Data has several batches in flight on the
replica at once (``JobReplica.__call__`` is a coroutine; batches overlap on the actor's event loop).

A death is charged to an input only when the input ran alone in the process: the ordinary inputs
that were in flight beside the input that killed it (in its own batch or in another) must get their
real answers, however many batches overlap, how many inputs kill the process, and whether a retried
batch runs beside a fresh one.  Without Ray or a model: Ray's part (restart the replica, retry every
batch that was in flight, send fresh ones) is ``run_job``, a process death is a flag that stops
every write of the incarnation at once (nothing is written after a SIGKILL), and time is steps of
the event loop, so every interleaving is the same on every run."""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_pipeline.cluster.job_replica import CRASH_LIMIT, JobReplica, ReplicaSpec
from mm_pipeline.jobs.job_output import JobOutput


class ProcessDied(Exception):
    """Stands for the replica's process dying: its batches return nothing and are retried."""


class _Mortal:
    """A journal of one incarnation of the process: after its death nothing more reaches the file."""

    def __init__(self, journal, process: "Incarnation") -> None:
        self.journal, self.process = journal, process

    def append(self, row: dict) -> None:
        self.process.check()
        self.journal.append(row)

    def sync(self) -> None:
        self.process.check()
        self.journal.sync()


class Incarnation(JobReplica):
    """One life of the replica's process.  An input takes ``steps[name]`` event-loop steps (3 unless
    given); a poison input kills the process when its steps are done, and every other input in
    flight stops at its next step."""

    def __init__(self, spec: ReplicaSpec, poison: set[str], steps: dict[str, int]) -> None:
        self.poison, self.steps, self.dead, self.answered = poison, steps, False, []
        super().__init__(spec)
        self.journal, self.started = _Mortal(self.journal, self), _Mortal(self.started, self)

    def check(self) -> None:
        if self.dead:
            raise ProcessDied("the process is gone")

    def identity(self) -> tuple[str, str]:
        return "actor-1", "node-a"  # a restart keeps the actor id, hence the shard

    def load_engine(self, spec: ReplicaSpec) -> SimpleNamespace:
        return SimpleNamespace(stats=lambda: None)

    def cache_counters(self) -> dict[str, int]:
        return {}

    def keys(self, batch):
        return [str(k) for k in batch["input"]]

    async def answer(self, batch, i, n):
        name = str(batch["input"][i])
        for _ in range(self.steps.get(name, 3)):
            await asyncio.sleep(0)
            self.check()
        if name in self.poison:
            self.dead = True
            raise ProcessDied(name)
        self.answered.append(name)
        return {"input": name, "caption": f"cap {name}", "error": None, "completion_tokens": 3}

    def outcome(self, row):
        return row["error"], row["completion_tokens"]

    def crashed(self, batch, i, message):
        return {"input": str(batch["input"][i]), "caption": None, "error": message, "completion_tokens": 0}


@dataclass
class JobRun:
    errors: dict[str, str]  # each input's error in its batch's result ("" when answered)
    deaths: int  # of the replica's process
    answered: list[str]  # inputs answered, over every incarnation


def run_job(output: JobOutput, waves: list[list[list[str]]], poison: set[str],
            steps: dict[str, int] | None = None, max_deaths: int = 50) -> JobRun:
    """Ray's part: each incarnation of the replica gets, all in flight at once, the batches that
    were in flight when the last one died (retried) and ``waves[k]`` (fresh batches, k = the
    incarnation).  Without ``steps`` a poison input dies at its first step, the others take three."""
    spec = ReplicaSpec(model_dir="unused", engine_config=None, output=output)
    pending: list[list[str]] = []
    run = JobRun(errors={}, deaths=0, answered=[])
    for k in range(max_deaths + len(waves)):
        pending += waves[k] if k < len(waves) else []
        if not pending and k >= len(waves):
            return run
        replica = Incarnation(spec, poison, steps if steps is not None else dict.fromkeys(poison, 1))

        async def in_flight():
            return await asyncio.gather(*(replica({"input": np.array(b, dtype=object)}) for b in pending),
                                        return_exceptions=True)

        outs = asyncio.run(in_flight())
        for batch, out in zip(pending, outs):
            if not isinstance(out, BaseException):
                run.errors.update(zip(out["key"], out["error"]))
            elif not isinstance(out, ProcessDied):
                raise out
        pending = [b for b, out in zip(pending, outs) if isinstance(out, ProcessDied)]
        run.deaths += replica.dead
        run.answered += replica.answered
    raise AssertionError(f"retried for good: {run.deaths} deaths")


def _rows(output: JobOutput) -> dict[str, dict]:
    rows = [json.loads(ln) for shard in output.shard_paths() for ln in shard.read_text().splitlines()]
    assert len(rows) == len({r["input"] for r in rows})  # each input once across the shards
    return {r["input"]: r for r in rows}


def test_an_input_that_kills_its_replica_gets_an_error_row_instead_of_endless_retries(tmp_path):
    """Ray restarted the replica and retried the batch forever: nothing recorded which input was in
    flight.  Each start is journaled; the inputs in flight at a death run alone afterwards, and one
    that took the process down CRASH_LIMIT times alone gets an error row naming the crash (its first
    death, beside the batch's other inputs, named nobody)."""
    output = JobOutput(tmp_path / "out.jsonl", key="input")
    run = run_job(output, [[["a", "poison", "c", "d"]]], {"poison"}, steps={"a": 0, "poison": 1, "c": 2, "d": 3})
    assert run.deaths == 1 + CRASH_LIMIT  # then its error row, not another try
    assert run.answered == ["a", "c", "d"]  # a before the first death, c and d (each alone) at the end
    assert "died 2 times while answering this input alone" in run.errors["poison"]
    assert [bool(run.errors[k]) for k in ("a", "poison", "c", "d")] == [False, True, False, False]
    starts = [json.loads(ln) for ln in output.started_path("actor-1").read_text().splitlines()]
    assert starts[:4] == [{"started": k} for k in ("a", "poison", "c", "d")]  # side by side
    assert starts[4:] == [{"started": k, "alone": True} for k in ("poison", "poison", "c", "d")]
    rows = _rows(output)
    assert set(rows) == {"a", "poison", "c", "d"} and rows["poison"]["caption"] is None
    assert output.merge(["a", "poison", "c", "d"]).rows == 4


# Each scenario: (waves of batches, poison inputs).  The innocent input a1 was in flight at two
# deaths, each caused by another input; each time it was the only input of its own batch running.
SCENARIOS = {
    # the poison's batch and another retried side by side: a1 runs "alone" in its batch, beside p
    "poison in the batch beside": ([[["a1", "a2"], ["p", "b2"]]], {"p"}),
    # a retried batch (a1, p) beside a fresh batch whose first input kills the process too
    "retried batch beside a fresh one": ([[["a1", "p"]], [["q", "b1"]]], {"p", "q"}),
    # two poisons in two batches at once: whichever dies, the other batch's inputs were in flight
    "two poisons at once": ([[["a1", "p"], ["q", "b1"]]], {"p", "q"}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_input_in_flight_beside_a_poison_gets_its_real_answer(tmp_path, scenario):
    """The replica ran an input 'alone' only within its batch: another batch's poison input ran
    beside it, and an ordinary input in flight at CRASH_LIMIT deaths got a replica-crashed error row
    instead of its answer.  Now a death is charged only to an input that ran alone in the process."""
    waves, poison = SCENARIOS[scenario]
    output = JobOutput(tmp_path / "out.jsonl", key="input")
    run = run_job(output, waves, poison)
    rows = _rows(output)
    inputs = {name for wave in waves for batch in wave for name in batch}
    assert set(rows) == inputs
    for name in inputs - poison:
        assert rows[name]["caption"] == f"cap {name}" and not run.errors[name], (name, rows[name]["error"])
    for name in poison:
        assert rows[name]["caption"] is None and f"died {CRASH_LIMIT} times" in run.errors[name]
    # each poison input: one death beside others (charged to nobody), then CRASH_LIMIT deaths alone
    assert run.deaths <= (1 + CRASH_LIMIT) * len(poison)
    assert sorted(run.answered) == sorted(inputs - poison)  # each once


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_overlap_of_batches_charges_only_poison_inputs(data):
    """Batches of any size arriving over several incarnations, any inputs poison, any durations:
    every ordinary input gets its answer, every poison input an error row after a bounded number of
    deaths, and each input has one row."""
    names = [f"i{n}" for n in range(data.draw(st.integers(1, 9), label="inputs"))]
    poison = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=3), label="poison"))
    steps = {n: data.draw(st.integers(0, 4), label=f"steps {n}") for n in names}
    waves: list[list[list[str]]] = []
    rest = list(names)
    while rest:
        size = data.draw(st.integers(1, len(rest)), label="batch size")
        wave = data.draw(st.integers(0, 2), label="arrives at incarnation")
        while len(waves) <= wave:
            waves.append([])
        waves[wave].append(rest[:size])
        rest = rest[size:]
    with tempfile.TemporaryDirectory() as tmp:
        output = JobOutput(Path(tmp) / "out.jsonl", key="input")
        run = run_job(output, waves, poison, steps)
        rows = _rows(output)
    assert set(rows) == set(names) == set(run.errors)
    assert {n for n in names if run.errors[n]} == poison
    assert all(rows[n]["caption"] == f"cap {n}" for n in set(names) - poison)
    assert sorted(run.answered) == sorted(set(names) - poison)
    assert run.deaths <= (1 + CRASH_LIMIT) * len(poison)


def test_start_markers_of_replicas_before_alone_count_as_side_by_side(tmp_path):
    """An interrupted job's shards from before the ``alone`` field: ``x`` was started twice with no
    row (in flight at two deaths, cause unknown), which once meant an error row.  Resumed, x and the
    poison p run alone: x is answered, and p still ends with its error row."""
    output = JobOutput(tmp_path / "out.jsonl", key="input")
    output.parts_dir.mkdir()
    output.started_path("old-actor").write_text('{"started": "x"}\n{"started": "p"}\n{"started": "x"}\n')
    run = run_job(output, [[["x", "p", "y"]]], {"p"})
    assert run.answered == ["x", "y"]  # y, fresh, waits for the suspects and p's death stops it
    assert not run.errors["x"] and f"died {CRASH_LIMIT} times" in run.errors["p"]
    assert run.deaths == CRASH_LIMIT  # p's deaths now, each alone
    assert _rows(output)["x"]["caption"] == "cap x"
