"""``mmserve batch --ray`` reads its input in chunks, without Ray: the driver's pass keeps keys and
byte ranges, never lines, and the read stage gives back exactly the lines the single-process job
would answer (``input_lines`` minus the done ones), numbered as it numbers them."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mm_pipeline.cluster.batch_dataset import ChunkLimits, LineChunk, chunk_lines, plan_input, read_chunks
from mm_pipeline.cluster.batch_replica import line_of
from mm_pipeline.server.batches.lines import input_lines, line_key


def _request(cid: str, pad: str = "") -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi" + pad}]}}, ensure_ascii=False).encode()


def _awkward_file(path: Path) -> Path:
    """CRLF ends, no newline at the end, blank lines (one of U+3000 only), a line that is not UTF-8,
    broken JSON, a custom_id with U+2028 in it, lines of different lengths."""
    lines = [_request(f"c{i:03d}", "x" * (i % 11)) for i in range(60)]
    lines[3] = b"{not json"
    lines[7], lines[9] = b"   ", "\u3000".encode()
    lines[8] = b"\xff\xfe not utf-8"
    lines[12] = _request("u\u2028v")
    path.write_bytes(b"\r\n".join(lines))
    return path


@pytest.mark.parametrize("limits", [ChunkLimits(lines=4, bytes=1 << 20), ChunkLimits(lines=1000, bytes=300),
                                    ChunkLimits()])
def test_the_chunks_hold_exactly_the_lines_to_answer(tmp_path, limits):
    src = _awkward_file(tmp_path / "in.jsonl")
    # 4: the line "{not json", known by its number (its error row's error.line), as without --ray
    done = {"c000", "c005", "c006", "c020", "c059", "u\u2028v", "not-in-the-file", 4}
    plan = plan_input(src, done, limits)
    everything = list(input_lines(src))
    want = [(n, raw) for n, raw, cid in everything if (cid if cid is not None else n) not in done]
    got = [(n, line_of(line)) for chunk in plan.chunks for n, line in chunk_lines(str(src), chunk)]
    assert got == want  # every line to answer once, in file order, numbered as input_lines does
    assert plan.total == len(everything) == 58 and plan.skipped == 7
    assert plan.expected == [cid if cid is not None else n for n, _, cid in everything]
    for chunk in plan.chunks:
        lines = list(chunk_lines(str(src), chunk))
        assert 1 <= len(lines) <= limits.lines
        assert chunk.end - chunk.start <= limits.bytes or len(lines) == 1  # a longer line: a chunk of its own
        assert not {line_key(n, line_of(raw)) for n, raw in lines} & done  # a done line ends a chunk
    # the read stage (columns as Ray Data hands them) gives the same lines, as bytes
    columns = {k: np.array([getattr(c, k) for c in plan.chunks]) for k in ("start", "end", "first_line")}
    rows = read_chunks(columns, str(src))
    assert list(zip(rows["number"], map(line_of, rows["raw"]))) == want


def test_nothing_to_answer_makes_no_chunk(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(_request(c) for c in ("a", "b")) + b"\n\n")
    plan = plan_input(src, {"a", "b"})
    assert (plan.total, plan.skipped, plan.expected, plan.chunks) == (2, 2, ["a", "b"], [])


def test_the_plan_keeps_keys_and_ranges_never_lines(tmp_path):
    """The Ray batch job kept every line to answer in the driver (a list handed to
    ``ray.data.from_items``), so its memory grew with the file; the plan holds custom_ids and three
    numbers per chunk, and the lines stay in the file until a read task reads them."""
    src = tmp_path / "in.jsonl"
    with src.open("wb") as f:
        for i in range(4000):
            f.write(_request(f"r{i:05d}", "x" * 4000) + b"\n")  # 16 MB of lines
    tracemalloc.start()
    try:
        plan = plan_input(src, set())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # 4000 custom_ids and a few chunks, not 16 MB of lines
    assert len(plan.chunks) == 4 and plan.total == 4000  # 4 MB chunks of ~1000 lines
    assert next(chunk_lines(str(src), plan.chunks[2]))[0] == plan.chunks[2].first_line


def test_a_chunk_is_read_from_its_range_only(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(_request(f"r{i}") for i in range(10)) + b"\n")
    at = [0]
    for line in src.read_bytes().splitlines(keepends=True):
        at.append(at[-1] + len(line))
    assert [n for n, _ in chunk_lines(str(src), LineChunk(at[3], at[6], 4))] == [4, 5, 6]
    src.write_bytes(src.read_bytes()[:at[4]])  # a file cut short since the plan: no row is made up
    assert [n for n, _ in chunk_lines(str(src), LineChunk(at[3], at[6], 4))] == [4]


def test_the_replica_takes_a_line_as_input_lines_gives_it():
    assert line_of(np.bytes_(b'{"custom_id": "a"}\r\n')) == '{"custom_id": "a"}\r\n'
    assert line_of(b"\xff oops\n") == b"\xff oops\n"  # parse_line makes it an invalid_json error line
    with pytest.raises(ValueError):
        ChunkLimits(lines=0)
