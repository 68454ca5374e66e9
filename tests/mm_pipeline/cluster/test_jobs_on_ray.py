"""``mmserve caption --ray`` / ``mmserve batch --ray`` on the session's local Ray cluster (2 CPUs,
loopback; replicas at 0.5 CPU and one torch thread each) with a tiny omni checkpoint:

- 2 replicas write exactly the single-process rows, broken files as error rows, and report per
  replica; a re-run resumes (only the rows it lacks), with a warm Redis reporting its hits;
- a replica SIGKILLed mid-run is restarted by Ray and the job ends with every input once; the job
  holds its output's lock while it runs;
- a batch file (CRLF line ends, U+2028 inside strings) gives the single-process job's answers, and a
  re-run skips every custom_id;
- a 16 MB batch file costs the driver its keys, not its lines (read tasks read them, under the
  job's object-store window), and a run on an output missing three lines answers only those;
- behind a slow (stand-in) replica, caption's read tasks stay within the job's read-ahead window,
  and an input larger than the whole window still goes through.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.support.caption_inputs import folder_with_broken_files
from tests.support.paths import SAMPLE_MEDIA

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = ["--device", "cpu", "--kv-tokens", "4096"]
RAY = ["--ray", "--replicas", "2", "--cpus-per-replica", "0.5", "--batch-size", "2"]
COMPARED = ("input", "modality", "caption", "error", "content_hash", "prompt_tokens", "completion_tokens")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "tiny-omni", seed=0)


def _rows(path: Path) -> dict[str, dict]:
    return {r["input"]: {k: r[k] for k in COMPARED} for r in map(json.loads, path.read_text().splitlines())}


def test_two_replicas_write_the_single_process_rows_and_resume_with_warm_redis(
        ray_local, redis_server, model_dir, tmp_path, capsys):
    from mm_pipeline.cli import main

    folder = tmp_path / "media"
    folder.mkdir()
    expect = folder_with_broken_files(folder)
    common = ["caption", str(folder), "--model", str(model_dir), "--max-tokens", "6", *ENGINE]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "ray.jsonl"
    assert main([*common, "--out", str(ref)]) == 0
    capsys.readouterr()
    redis = ["--redis-url", f"redis://127.0.0.1:{redis_server}/3"]
    assert main([*common, "--out", str(out), *RAY, *redis]) == 0
    err = capsys.readouterr().err
    assert _rows(out) == _rows(ref)  # the same rows, broken files included
    assert len(out.read_text().splitlines()) == len(expect) and not out.with_name("ray.jsonl.parts").exists()
    assert sum(r["error"] is not None for r in _rows(out).values()) == 4
    assert "captioned 5 of 9 inputs" in err and "4 failed" in err and "each input once" in err
    lines = err.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("replica ") and "cache hits" in ln)
    # one line per replica that got work (Ray Data may hand every batch to the first idle replica
    # when reads are slower than captions), and together they did every input once
    per_replica = [ln.split() for ln in lines[at + 1:] if len(ln.split()) >= 6 and ln.split()[2].isdigit()]
    assert 1 <= len(per_replica) <= 2 and sum(int(r[2]) for r in per_replica) == len(expect), err

    # resume: drop a good and a broken row; the re-run redoes only those, the good one from Redis
    # (new replicas start with an empty memory tier: the hit can only come from the shared tier)
    kept = [ln for ln in out.read_text().splitlines()
            if Path(json.loads(ln)["input"]).name not in ("image_000001.png", "noise.jpg")]
    out.write_text("\n".join(kept) + "\n")
    assert main([*common, "--out", str(out), "--ray", "--replicas", "1", "--cpus-per-replica", "0.5", *redis]) == 0
    err = capsys.readouterr().err
    assert "captioned 1 of 2 inputs" in err and "7 already in the output were skipped" in err
    assert _rows(out) == _rows(ref)
    hits = dict(kv.split("=") for kv in err.split("cache hits: ")[1].splitlines()[0].split(", "))
    assert int(hits["encoder_cache_hits.redis"]) >= 1, err


def _kill_first_replica_with_a_row(parts: Path, done: threading.Event, killed: list[int],
                                   locked: list[bool]) -> None:
    """SIGKILL the process of the first replica whose shard has a row (a crash: Ray restarts it);
    first, try the output's lock as a second job would (``locked``: whether the job held it)."""
    from ray._private import state

    from mm_pipeline.jobs.resume import OutputFileError, open_output

    while not done.is_set():
        for shard in sorted(parts.glob("shard-*.jsonl")) if parts.is_dir() else []:
            if shard.stat().st_size:
                try:
                    open_output(parts.with_name(parts.name.removesuffix(".parts")), end_torn_line=False).close()
                    locked.append(False)
                except OutputFileError:
                    locked.append(True)
                pid = state.actors(shard.stem.removeprefix("shard-"))["Pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.05)


def test_a_killed_replica_is_restarted_and_every_input_is_written_once(ray_local, model_dir, tmp_path):
    from mm_pipeline.cli import build_parser, engine_config
    from mm_pipeline.cluster.caption_dataset import run_caption_on_ray
    from mm_pipeline.cluster.distributed_job import RayJobConfig
    from mm_pipeline.cluster.job_replica import ReplicaSpec
    from mm_pipeline.jobs.caption import CaptionConfig
    from mm_pipeline.jobs.job_output import JobOutput

    inputs = []
    for i in range(6):  # distinct names (the same content: later ones hit the encoder cache)
        for name in ("image_000001.png", "audio_000003.wav"):
            dst = tmp_path / "in" / f"{i}_{name}"
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(SAMPLE_MEDIA / name, dst)
            inputs.append(str(dst))
    output = JobOutput(tmp_path / "out.parquet", key="input", format="parquet")
    args = build_parser().parse_args(["caption", "x", *ENGINE])
    spec = ReplicaSpec(model_dir=str(model_dir), engine_config=engine_config(args), output=output)
    done, killed, locked = threading.Event(), [], []
    killer = threading.Thread(target=_kill_first_replica_with_a_row, args=(output.parts_dir, done, killed, locked))
    killer.start()
    try:
        summary, result = run_caption_on_ray(
            ray_local, inputs, spec, CaptionConfig(max_tokens=16),
            RayJobConfig(replicas=2, cpus_per_replica=0.5, batch_size=2))
    finally:
        done.set()
        killer.join()
    assert killed, "the job finished before a replica wrote a row"
    assert locked == [True]  # a second job on this output would have been refused while it ran
    import pyarrow.parquet as pq

    rows = pq.read_table(output.path).to_pylist()
    assert sorted(r["input"] for r in rows) == sorted(inputs)  # every input, once
    assert all(r["error"] is None and r["caption"] is not None for r in rows)
    assert result.merge.duplicates == 0 and result.duplicate_results == 0  # none written twice
    assert summary.succeeded == len(inputs) and summary.failed == 0
    assert sum(r.items for r in result.replicas) == len(inputs)


def test_batch_on_ray_answers_like_the_single_process_job(ray_local, model_dir, tmp_path, capsys):
    from mm_pipeline.cli import main

    def chat(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 5, "temperature": 0}

    lines = [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat("hi")}),
             "{not json",
             json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}}),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat("bye")}),
             # U+2028 inside JSON strings, written raw: neither the input nor the output splits there
             json.dumps({"custom_id": "d\u2028e", "method": "POST", "url": "/v1/chat/completions",
                         "body": chat("x\u2028y")}, ensure_ascii=False)]
    src = tmp_path / "in.jsonl"
    src.write_bytes("\r\n".join(lines).encode())  # CRLF, and no newline after the last line
    common = ["batch", "-i", str(src), "--model", str(model_dir), *ENGINE]
    ray = ["--ray", "--replicas", "1", "--cpus-per-replica", "0.5"]
    assert main([*common, "-o", str(tmp_path / "ref.jsonl")]) == 0
    assert main([*common, "-o", str(tmp_path / "ray.jsonl"), *ray]) == 0
    assert "each input once" in capsys.readouterr().err

    def answers(path: Path) -> dict:
        out = {}
        for rec in (json.loads(ln) for ln in path.read_bytes().split(b"\n") if ln):
            resp = rec["response"] or {}
            body = resp.get("body") or {}
            text = body["choices"][0]["message"]["content"] if resp.get("status_code") == 200 else None
            out[rec["custom_id"]] = (resp.get("status_code"), text, (rec["error"] or {}).get("code"))
        return out

    ref, ray_out = answers(tmp_path / "ref.jsonl"), answers(tmp_path / "ray.jsonl")
    assert ray_out == ref and ref["a"][0] == 200 and ref["b"][0] == 415 and ref[None][2] == "invalid_json"
    assert ref["d\u2028e"][0] == 200
    # a re-run resumes: every custom_id is done (the one with U+2028 included), and the line without
    # one by its line number (its row's error.line), as without --ray
    assert main([*common, "-o", str(tmp_path / "ray.jsonl"), *ray]) == 0
    err = capsys.readouterr().err
    assert "0 succeeded, 0 failed of 0 requests" in err and "5 already in the output were skipped" in err, err
    assert answers(tmp_path / "ray.jsonl") == ref


def test_batch_on_ray_streams_its_input_and_resumes(ray_local, model_dir, tmp_path):
    """The Ray batch job kept every line still to answer in the driver (a list for
    ``ray.data.from_items``) until the job ended: its memory grew with the input file.  The driver
    now holds custom_ids and chunk ranges; read tasks read the lines.  16 MB of lines (a wrong url
    each: an error line with no model call, so the test stays cheap) cost the driver ~2 MB, mostly
    Ray Data's own.  The first run resumes an output that has all but three lines."""
    import tracemalloc

    from ray.data import DataContext

    from mm_pipeline.cli import build_parser, engine_config
    from mm_pipeline.cluster.batch_dataset import run_batch_on_ray
    from mm_pipeline.cluster.distributed_job import RayJobConfig
    from mm_pipeline.cluster.job_replica import ReplicaSpec
    from mm_pipeline.jobs.job_output import JobOutput

    n, pad = 500, "x" * 32000
    src = tmp_path / "in.jsonl"
    with src.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i:05d}", "method": "POST", "url": "/v1/nope",
                                "body": {"messages": [{"role": "user", "content": pad}]}}) + "\n")
    engine = engine_config(build_parser().parse_args(["batch", "-i", "x", "-o", "y", *ENGINE]))
    config = RayJobConfig(replicas=1, cpus_per_replica=0.5, batch_size=16)

    def run(out: Path) -> tuple:
        spec = ReplicaSpec(model_dir=str(model_dir), engine_config=engine, output=JobOutput(out, key="custom_id"))
        return run_batch_on_ray(ray_local, src, spec, config)

    # resume (and the warm-up of Ray Data's code paths, so the measured run below counts the job)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(json.dumps({"custom_id": f"r{i:05d}", "response": None, "error": {"code": "earlier"}})
                               + "\n" for i in range(n) if i not in (0, 277, n - 1)))
    summary, result = run(resumed)
    assert (summary.total, summary.skipped, summary.failed, result.merge.new_rows) == (n, n - 3, 3, 3)
    rows = [json.loads(ln) for ln in resumed.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"r{i:05d}" for i in range(n)]  # each once
    redone = {r["custom_id"] for r in rows if r["error"]["code"] == "invalid_url"}
    assert redone == {"r00000", "r00277", f"r{n - 1:05d}"}

    fresh = tmp_path / "fresh.jsonl"
    tracemalloc.start()
    try:
        summary, result = run(fresh)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert src.stat().st_size > 15 << 20 and peak < 6 << 20, peak  # not the 16 MB of lines
    assert (summary.failed, result.merge.rows, result.duplicate_results) == (n, n, 0)
    assert [json.loads(ln)["custom_id"] for ln in fresh.read_text().splitlines()] == [f"r{i:05d}" for i in range(n)]
    # the reads ran under the job's window (Ray Data's default would let them fill the object store)
    from mm_pipeline.cluster.batch_dataset import CHUNK_BYTES, CHUNKS_IN_FLIGHT

    window = DataContext.get_current().execution_options.resource_limits.object_store_memory
    assert window == config.replicas * CHUNKS_IN_FLIGHT * CHUNK_BYTES



def _most_read_ahead(marks: Path) -> int:
    """The most inputs read and not yet captioned at any moment, from the markers' timestamps
    (``read-*``: the read stage read it, ``done-*``: the replica finished it)."""
    events = sorted((float(m.read_text()), -1 if m.name.startswith("done-") else 1) for m in marks.iterdir())
    ahead = most = 0
    for _, step in events:  # at a tie a caption counts before a read
        ahead += step
        most = max(most, ahead)
    return most


def test_caption_on_ray_reads_no_further_ahead_of_a_slow_replica_than_its_window(ray_local, tmp_path, monkeypatch):
    """``caption --ray`` gave Ray Data no byte limit of its own (Ray Data's is half the object
    store): behind a slow replica its read tasks read nearly every input into the object store
    before the replica had captioned a few.  The job's window, ``read_ahead_bytes`` per replica
    (4 MiB here: four of the 1 MiB inputs), now holds them back, and an input larger than the whole
    window still goes through.  The job is the real one but for its replica, a stand-in that loads
    no model and takes 0.3 s a batch; the read stage marks each input it read."""
    import asyncio

    from ray.data import DataContext

    from mm_pipeline.cli import build_parser, engine_config
    from mm_pipeline.cluster import caption_dataset
    from mm_pipeline.cluster.distributed_job import RayJobConfig
    from mm_pipeline.cluster.job_replica import JobReplica, ReplicaSpec
    from mm_pipeline.jobs.caption import CaptionConfig
    from mm_pipeline.jobs.job_output import JobOutput

    marks, folder = tmp_path / "marks", tmp_path / "media"
    marks.mkdir()
    folder.mkdir()
    inputs = []
    for i in range(24):  # PNGs by their magic bytes (nothing decodes them); input 9 is 6 MiB
        path = folder / f"{i:03d}.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes((6 if i == 9 else 1) << 20))
        inputs.append(str(path))
    read_batch = caption_dataset.read_batch

    def read_and_mark(batch, max_bytes=None):
        out = read_batch(batch, max_bytes)
        for p in out["input"]:
            (marks / f"read-{Path(p).name}").write_text(repr(time.time()))
        return out

    class SlowReplica(JobReplica):  # CaptionReplica's protocol, without its engine (or its imports)
        def __init__(self, spec, caption):
            super().__init__(spec)

        def load_engine(self, spec):
            return None

        def cache_counters(self):
            return {}

        def keys(self, batch):
            return [str(p) for p in batch["input"]]

        async def answer(self, batch, i, n):
            await asyncio.sleep(0.3)
            (marks / f"done-{Path(str(batch['input'][i])).name}").write_text(repr(time.time()))
            return {"input": str(batch["input"][i]), "error": batch["read_error"][i] or None,
                    "bytes": len(batch["data"][i]), "completion_tokens": 0}

        def outcome(self, row):
            return row["error"], 0

        def crashed(self, batch, i, message):
            return {"input": str(batch["input"][i]), "error": message, "completion_tokens": 0}

    monkeypatch.setattr(caption_dataset, "read_batch", read_and_mark)
    monkeypatch.setattr(caption_dataset, "CaptionReplica", SlowReplica)
    engine = engine_config(build_parser().parse_args(["caption", "x", *ENGINE]))
    output = JobOutput(tmp_path / "out.jsonl", key="input")
    spec = ReplicaSpec(model_dir="unused", engine_config=engine, output=output)
    # 24 inputs, full batches of 2: a last batch of one would wait for the read stage's end, which
    # Ray Data, its budget spent by a window this small, may hold back for 10 s (its idle check)
    config = RayJobConfig(replicas=1, cpus_per_replica=0.5, batch_size=2, read_tasks=2, read_ahead_bytes=4 << 20)
    summary, result = caption_dataset.run_caption_on_ray(ray_local, inputs, spec, CaptionConfig(), config)

    rows = [json.loads(ln) for ln in output.path.read_text().splitlines()]
    assert [r["input"] for r in rows] == inputs and summary.succeeded == len(inputs)  # each once, none failed
    assert rows[9]["bytes"] == 8 + (6 << 20)  # the input larger than the window went through
    assert DataContext.get_current().execution_options.resource_limits.object_store_memory == 4 << 20
    most = _most_read_ahead(marks)
    # at most the window (4 inputs) and the reads Ray Data starts before it knows their size
    # (read_tasks blocks of 2); without the window, 18 of the 24 were read ahead at once
    assert most <= 6, most
