"""Sharded job output without Ray: shard journals and their index, resume over the final file and
the shards, the exactly-once merge (JSONL and Parquet), per-replica statistics."""

from __future__ import annotations

import json
import os

import pytest

from mm_pipeline.jobs.job_output import IncompleteJobError, JobOutput
from mm_pipeline.jobs.replica_stats import ReplicaStats
from mm_pipeline.jobs.shard_journal import ShardIndex, ShardJournal


def _row(name: str, error: str | None = None) -> dict:
    return {"input": name, "caption": None if error else f"cap {name}", "error": error,
            "timings": {"total_s": 0.1} if error else {"read_s": 0.0, "total_s": 0.2}}


def test_index_tails_shards_and_skips_torn_lines(tmp_path):
    out = JobOutput(tmp_path / "o.jsonl", key="input")
    a = ShardJournal(out.shard_path("a"))
    index = ShardIndex(out.parts_dir, "input", lambda r: r["error"])
    a.append(_row("x"))
    index.refresh()
    assert index.rows == {"x": None}
    # a replica killed mid-write leaves half a line: not a row, and the next writer starts afresh
    with out.shard_path("b").open("w") as f:
        f.write(json.dumps(_row("y", "bad")) + "\n" + '{"input": "z", "capt')
    index.refresh()
    assert index.rows == {"x": None, "y": "bad"}
    b = ShardJournal(out.shard_path("b"))  # the restarted replica reopens its shard
    b.append(_row("z"))
    a.append(_row("w"))
    index.refresh()  # reads only what was appended since
    assert index.rows == {"x": None, "y": "bad", "z": None, "w": None}
    assert out.done_keys() == {"x", "y", "z", "w"}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_merge_is_exactly_once_and_resumable(tmp_path, fmt):
    out = JobOutput(tmp_path / f"o.{fmt}", key="input", format=fmt)
    j = ShardJournal(out.shard_path("r1"))
    for name in ("b", "a"):
        j.append(_row(name))
    with pytest.raises(IncompleteJobError, match="1 inputs have no output row.*'c'"):
        out.merge(["a", "b", "c"])
    assert out.parts_dir.is_dir() and not out.path.exists()  # nothing lost: the parts stay for a re-run
    ShardJournal(out.shard_path("r2")).append(_row("c", "UnsupportedMediaType: noise"))
    ShardJournal(out.shard_path("r3")).append(_row("a"))  # a copy a retried batch wrote again
    report = out.merge(["a", "b", "c"])
    assert (report.rows, report.new_rows, report.duplicates, report.shards) == (3, 3, 1, 3)
    assert not out.parts_dir.exists()
    rows = list(out.final_rows())
    assert [r["input"] for r in rows] == ["a", "b", "c"]  # the inputs' order, not completion order
    assert rows[2]["error"] and rows[0]["caption"] == "cap a"
    assert out.done_keys() == {"a", "b", "c"}
    # a later run adds inputs: the old rows stay first, the new ones follow
    ShardJournal(out.shard_path("r9")).append(_row("d"))
    report = out.merge(["a", "b", "c", "d"])
    assert (report.rows, report.new_rows, report.duplicates) == (4, 1, 0)
    assert [r["input"] for r in list(out.final_rows())] == ["a", "b", "c", "d"]


def test_parquet_refuses_to_replace_a_jsonl_file(tmp_path):
    (tmp_path / "o.parquet").write_text(json.dumps(_row("a")) + "\n")
    with pytest.raises(ValueError, match="not a Parquet file"):
        JobOutput(tmp_path / "o.parquet", key="input", format="parquet")
    with pytest.raises(ValueError, match="jsonl or parquet"):
        JobOutput(tmp_path / "o.csv", key="input", format="csv")  # type: ignore[arg-type]


def test_a_jsonl_job_refuses_a_parquet_output(tmp_path):
    """A JSONL job (``caption --ray`` without ``--format parquet``) read a Parquet output as no rows
    and its merge replaced them with the new rows only; the single-process job appended JSON lines
    to it.  Both are refused, by the one check (``resume.check_format``)."""
    from mm_pipeline.jobs.resume import OutputFileError, check_output, open_output

    out = tmp_path / "o.parquet"
    first = JobOutput(out, key="input", format="parquet")
    ShardJournal(first.shard_path("r1")).append(_row("a"))
    first.merge(["a"])
    before = out.read_bytes()
    with pytest.raises(OutputFileError, match="is a Parquet file; give --format parquet"):
        JobOutput(out, key="input")
    with pytest.raises(OutputFileError, match="is a Parquet file"):
        check_output(out)
    with pytest.raises(OutputFileError, match="is a Parquet file"):
        open_output(out)
    assert out.read_bytes() == before  # nothing appended, nothing replaced
    # the file turned Parquet after the check: the lock (taken before the done keys) says so too
    jsonl = tmp_path / "o.jsonl"
    later = JobOutput(jsonl, key="input")
    jsonl.write_bytes(before)
    with pytest.raises(OutputFileError, match="is a Parquet file"):
        later.lock()
    open_output(jsonl, end_torn_line=False).close()  # the refused lock was let go
    assert [r["input"] for r in JobOutput(out, key="input", format="parquet").final_rows()] == ["a"]


def test_a_name_that_is_not_utf8_is_journaled_and_merged_under_its_own_key(tmp_path):
    """A shard encoded rows strictly: a file name that is not UTF-8 (a lone surrogate in Python)
    ended the replica at its row.  Every writer now writes a row as ``resume.row_bytes`` does, and
    the row reads back under the same key (the index, resume and the merge all find it)."""
    import os

    name = os.fsdecode(b"caf\xe9.jpg")  # 'caf\udce9.jpg'
    out = JobOutput(tmp_path / "o.jsonl", key="input")
    journal = ShardJournal(out.shard_path("r1"))
    journal.append(_row(name))
    journal.append(_row("ok.png"))
    index = ShardIndex(out.parts_dir, "input")
    index.refresh()
    assert set(index.rows) == {name, "ok.png"} and out.done_keys() == {name, "ok.png"}
    assert out.merge([name, "ok.png"]).rows == 2
    assert [r["input"] for r in out.final_rows()] == [name, "ok.png"]
    assert b"caf\\udce9.jpg" in out.path.read_bytes()  # its JSON escape, as the plain job writes it


def test_replica_stats_busy_time_restarts_and_cache():
    r = ReplicaStats("abc")
    r.add_batch(node="n1", pid=1, start=0.0, end=2.0, items=4, failed=1, cache={"encoder_cache_hits.redis": 3})
    r.add_batch(node="n1", pid=1, start=1.0, end=3.0, items=4, failed=0, cache={"encoder_cache_hits.redis": 5})
    r.add_batch(node="n1", pid=2, start=5.0, end=6.0, items=2, failed=0, cache={"encoder_cache_hits.redis": 1})
    assert r.busy_s == pytest.approx(4.0)  # [0, 3] and [5, 6]: overlapping batches count once
    assert r.items_per_s == pytest.approx(10 / 4.0)
    assert r.restarts == 1 and r.cache == {"encoder_cache_hits.redis": 6}  # per process: 5 (max) + 1
    lines = ReplicaStats.table([r])
    assert lines[0].split()[:3] == ["replica", "node", "items"]
    assert lines[1].split()[:6] == ["abc", "n1", "10", "1", "2.50", "1"]
    assert ReplicaStats.table([]) == []


def test_merge_streams_rows_and_hands_the_lock_to_the_new_file(tmp_path, monkeypatch):
    """The merge held every row of the final file and of the shards at once (memory grew with the
    output); it now holds keys and shard offsets, and reads each row again when it is written."""
    import tracemalloc

    from mm_pipeline.jobs import job_output
    from mm_pipeline.jobs.resume import OutputFileError, open_output

    out = JobOutput(tmp_path / "o.jsonl", key="input")
    pad = "word " * 400  # ~2 KB rows: 10 MB of them in all
    odd = os.fsdecode(b"caf\xe9.png")  # a name that is not UTF-8: written as its \udce9 escape
    with open_output(out.path) as f:  # an earlier run's rows, as the single-process job writes them
        for i in range(2500):
            f.write(json.dumps({**_row(f"old{i:05d}"), "caption": pad}) + "\n")
        f.write(json.dumps(_row(odd), ensure_ascii=False) + "\n" + '{"input": "torn')
    shards = [ShardJournal(out.shard_path(f"r{j}")) for j in range(2)]
    new = [f"new{i:05d}" for i in range(2500)]
    for i, name in enumerate(reversed(new)):  # completion order: the reverse of the inputs'
        shards[i % 2].append({**_row(name), "caption": pad})
    shards[0].append({"input": None, "caption": "a row without a key"})
    shards[1].append({**_row("new00007"), "caption": "a retried copy"})
    shards[1].append(_row("not-expected"))
    expected = [f"old{i:05d}" for i in range(2500)] + [odd] + new

    def rmtree(path):  # the moment between the new file taking the name and the parts going
        with pytest.raises(OutputFileError, match="another job"):
            open_output(out.path)
        real_rmtree(path)

    real_rmtree = job_output.shutil.rmtree
    monkeypatch.setattr(job_output.shutil, "rmtree", rmtree)
    tracemalloc.start()
    try:
        report = out.merge(expected)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20, peak  # keys and offsets (~1 MB), never the 10 MB of rows
    assert (report.rows, report.new_rows, report.duplicates) == (5003, 2502, 1)
    rows = list(out.final_rows())
    assert [r["input"] for r in rows] == expected + [None, "not-expected"]  # old, new in input order, the rest
    assert rows[2500]["input"] == odd and rows[2501 + 7]["caption"] == pad  # the first copy of new00007
    assert not out.parts_dir.exists()
    open_output(out.path).close()  # the lock went with the merge


def test_parquet_merge_writes_in_chunks_with_one_schema(tmp_path, monkeypatch):
    from mm_pipeline.jobs import job_output

    monkeypatch.setattr(job_output, "_CHUNK", 2)  # chunks of 2 rows: the schema must cover them all
    out = JobOutput(tmp_path / "o.parquet", key="input", format="parquet")
    out.lock().close()  # a --ray job creates the (empty) file to lock it: not a Parquet file yet
    assert out.done_keys() == set() and list(out.final_rows()) == []
    j = ShardJournal(out.shard_path("r1"))
    names = [f"in{i}" for i in range(5)]
    for name in names[:3]:  # caption null and timings {total_s} in the first chunk only
        j.append(_row(name, "UnsupportedMediaType: noise"))
    for name in names[3:]:
        j.append(_row(name))
    assert out.merge(names).rows == 5
    import pyarrow.parquet as pq

    assert pq.ParquetFile(out.path).metadata.num_row_groups == 3
    rows = list(out.final_rows())
    assert [r["input"] for r in rows] == names
    assert rows[0]["caption"] is None and rows[4]["caption"] == "cap in4"
    assert rows[0]["timings"] == {"total_s": 0.1, "read_s": None} and rows[4]["timings"]["read_s"] == 0.0
    ShardJournal(out.shard_path("r2")).append(_row("in5"))  # a later run: old rows read back in chunks
    assert out.merge(names + ["in5"]).new_rows == 1
    assert [r["input"] for r in out.final_rows()] == names + ["in5"]
