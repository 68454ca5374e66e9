"""The files a job reads and writes, without a model: the output opened for appending
(jobs/resume.py: a torn last line ended, the parent made, one job at a time, any row writable) and
a caption input read (jobs/media_input.py: only regular files, never more than the byte limit)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from mm_pipeline.errors import MediaTooLarge, UndecodableMediaError
from mm_pipeline.jobs.caption import CaptionJob
from mm_pipeline.jobs.media_input import error_text, read_media_input
from mm_pipeline.jobs.resume import OutputFileError, done_keys, open_output
from mm_pipeline.media.ingest_config import MediaLimits


# ---- the output -----------------------------------------------------------------------------------
def test_open_output_ends_a_torn_line_and_makes_the_parent(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "a"}) + "\n" + '{"custom_id": "to')  # a crash mid-row
    with open_output(out) as f:
        f.write(json.dumps({"custom_id": "b"}) + "\n")
    assert out.read_text().splitlines()[1:] == ['{"custom_id": "to', '{"custom_id": "b"}']
    assert done_keys(out, "custom_id") == {"a", "b"}  # the row after the torn line is not lost
    with open_output(out) as f:  # a whole last line is left as it is
        f.write("{}\n")
    assert out.read_text().endswith('{"custom_id": "b"}\n{}\n')
    deep = tmp_path / "new" / "dir" / "out.jsonl"
    open_output(deep).close()
    assert deep.is_file()


def test_open_output_is_one_job_at_a_time_and_refuses_a_directory(tmp_path):
    out = tmp_path / "out.jsonl"
    with open_output(out):
        with pytest.raises(OutputFileError, match="another job"):
            open_output(out)
    open_output(out).close()  # the lock ends with the job
    with pytest.raises(OutputFileError, match="Is a directory"):
        open_output(tmp_path)


def test_open_output_writes_a_lone_surrogate_as_its_json_escape(tmp_path):
    # a file name that is not UTF-8 comes from os.walk with surrogates: its row must still be written
    out = tmp_path / "out.jsonl"
    name = os.fsdecode(b"caf\xe9.png")
    with open_output(out) as f:
        f.write(json.dumps({"input": name}, ensure_ascii=False) + "\n")
    assert done_keys(out, "input") == {name}  # and read back as the same name when resuming


def _peak_bytes(fn):
    """(fn(), the peak of Python allocations while it ran)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_done_keys_streams_the_file_and_skips_an_over_long_line_unread(tmp_path):
    """done_keys read the whole file (and split it with str.splitlines): memory grew with the output,
    a hostile line was held whole, and a row whose caption held U+2028 or U+0085 was cut in two."""
    out = tmp_path / "out.jsonl"
    with out.open("wb") as f:
        f.write(json.dumps({"custom_id": "a"}).encode() + b"\r\n")  # a row ended by CRLF still counts
        f.write(b"x" * (50 << 20) + b"\n")  # 50 MB of garbage on one line
        f.write(json.dumps({"custom_id": "b\u2028c\x85d", "text": "e\u2028f"}, ensure_ascii=False).encode() + b"\n")
        f.write(b"[" * 100_000 + b"\n")  # a RecursionError in json before
        f.write(b'{"custom_id": "\xff", "x": 1}\n')  # not UTF-8: decoded with U+FFFD, still a row
        f.write(b'{"custom_id": "torn')
    keys, peak = _peak_bytes(lambda: done_keys(out, "custom_id", max_bytes=1 << 20))
    assert keys == {"a", "b\u2028c\x85d", "\ufffd"}
    assert peak < 8 << 20, peak  # the 50 MB line was never held whole: about the 1 MiB cap of it
    assert done_keys(tmp_path / "missing.jsonl", "custom_id") == set()


def test_done_keys_memory_is_for_the_keys_not_the_rows(tmp_path):
    out = tmp_path / "out.jsonl"
    row = {"input": "", "caption": "word " * 400, "error": None}
    with out.open("w") as f:
        for i in range(10_000):  # 20 MB of rows
            f.write(json.dumps({**row, "input": f"in/{i:06d}.png"}) + "\n")
    keys, peak = _peak_bytes(lambda: done_keys(out, "input"))
    assert len(keys) == 10_000
    assert peak < 4 << 20, peak  # the keys (~1.5 MB with the set), not the 20 MB file


# ---- caption inputs ---------------------------------------------------------------------------------
def _fifo(path: Path, unblock_after_s: float = 5.0) -> Path:
    """A FIFO, and a writer that comes and goes later: a reader stuck opening it (the bug) then goes
    on and the test fails, instead of hanging for good."""
    os.mkfifo(path)

    def unblock() -> None:
        time.sleep(unblock_after_s)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to unblock
            pass

    threading.Thread(target=unblock, daemon=True).start()
    return path


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = _fifo(tmp_path / "pipe.png")
    got = []
    reader = threading.Thread(target=lambda: got.append(read_media_input(str(fifo))), daemon=True)
    reader.start()
    reader.join(4)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert got[0].data is None and "not a regular file" in got[0].error


def test_an_input_error_leaves_out_its_place_in_the_jobs_own_chat():
    """The engine names a media error by the chat part it came from; a caption line names its input
    already, and its user never wrote that chat."""
    failed = UndecodableMediaError("x").located("messages[0].content[0]: video cannot be read",
                                                ("messages", 0, "content", 0))
    assert error_text(failed) == "UndecodableMediaError (media): video cannot be read"
    assert error_text(MediaTooLarge("media is 9 bytes")) == "MediaTooLarge (media): media is 9 bytes"


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.png"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that a whole read would hold in memory
    item = read_media_input(str(big), max_bytes=1000)
    assert item.data is None and item.error == "MediaTooLarge (media): media is 3221225472 bytes, limit 1000"
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    assert read_media_input(str(small), max_bytes=1000).error.startswith("UnsupportedMediaType")  # read, sniffed
    assert "not a regular file" in read_media_input(str(tmp_path)).error


class _NoModel:
    """Just enough engine for inputs that fail before generation (a model is never asked)."""

    config = SimpleNamespace(limits=MediaLimits(max_bytes=1000))

    def set_file_resolver(self, fn, *, local_files: bool = False) -> None:
        pass

    def stats(self) -> None:
        return None

    def generate(self, *args, **kwargs):
        raise AssertionError("no input here reaches the model")


def test_caption_job_refuses_fifos_and_inputs_over_the_engines_byte_limit(tmp_path):
    _fifo(tmp_path / "pipe.png")
    (tmp_path / "big.png").write_bytes(b"\x89PNG" + b"\0" * 2000)
    inputs = [str(tmp_path / "pipe.png"), str(tmp_path / "big.png")]
    summary = asyncio.run(CaptionJob(_NoModel()).run(inputs, tmp_path / "o.jsonl"))
    rows = {Path(r["input"]).name: r["error"] for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    assert summary.failed == 2
    assert "not a regular file" in rows["pipe.png"]
    assert rows["big.png"] == "MediaTooLarge (media): media is 2004 bytes, limit 1000"
