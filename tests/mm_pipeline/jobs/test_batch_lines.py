"""``mmserve batch``'s input lines and the one output row each gets, without a model (a fake
ChatService): lines that are not requests (bad JSON, not UTF-8, nested too deeply, no custom_id,
unsupported url) are classified without raising, and only newlines end a line; a line the engine
has no room for is sent again; a re-run skips done lines, by custom_id or, for a line without one,
by its line number, also after an interrupted run; lines sharing a custom_id are refused before any
runs. The job over the tiny omni model is test_batch.py's.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mm_pipeline.jobs.batch import BatchConfig, BatchJob
from mm_pipeline.server.batches.lines import custom_id_of, input_lines, parse_line

from tests.support.batches import DEEP_LINE, FakeService, request_line


def test_parse_line_classifies_without_raising():
    assert parse_line(1, "{not json").problem[1] == "invalid_json"
    assert parse_line(2, "[1]").problem[1] == "invalid_request"
    assert parse_line(3, json.dumps({"url": "/v1/chat/completions", "body": {}})).problem[1] == "missing_custom_id"
    assert parse_line(4, request_line("a", {}, url="/v1/embeddings")).problem[1] == "invalid_url"
    bad = parse_line(5, request_line("b", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}))
    assert bad.problem[0] == 400 and "temperature" in bad.problem[2]
    ok = parse_line(6, request_line("c", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}))
    assert ok.problem is None and ok.request.model is None  # the model field is ignored offline


def test_lines_that_are_not_utf8_or_too_deep_are_error_rows_not_a_crash(tmp_path):
    bad = request_line("caf\u00e9", {}).encode().replace("caf\\u00e9".encode(), b"caf\xe9")
    assert bad.count(b"\xe9") == 1
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([request_line("a", {}).encode(), bad, DEEP_LINE.encode(), b"1" * 5000,
                                request_line("b", {}).encode()]))
    lines = list(input_lines(src))  # decoded a line at a time: the bad byte does not end the file
    assert [(n, cid) for n, _, cid in lines] == [(1, "a"), (2, None), (3, None), (4, None), (5, "b")]
    assert lines[1][1] == bad + b"\n" and custom_id_of(DEEP_LINE) is None
    problems = [parse_line(n, raw).problem for n, raw, _ in lines[1:4]]
    assert [p[1] for p in problems] == ["invalid_json"] * 3
    assert "line 2: not UTF-8" in problems[0][2] and "nested too deeply" in problems[1][2]
    assert "line 4: not JSON" in problems[2][2]  # an integer longer than int() takes


def test_input_lines_split_on_newlines_only(tmp_path):
    """CRLF line ends and a last line without its newline are lines like any other; U+2028 and U+0085
    inside a JSON string (written raw, as ensure_ascii=False writes them) do not end a line."""
    body = {"messages": [{"role": "user", "content": "one\u2028two\x85three"}]}
    lines = [json.dumps({"custom_id": "a\u2028b", "method": "POST", "url": "/v1/chat/completions", "body": body},
                        ensure_ascii=False), "", request_line("c", body)]
    src = tmp_path / "in.jsonl"
    src.write_bytes("\r\n".join(lines).encode())
    got = list(input_lines(src))
    assert [(n, cid) for n, _, cid in got] == [(1, "a\u2028b"), (3, "c")]
    parsed = [parse_line(n, raw) for n, raw, _ in got]
    assert all(p.problem is None for p in parsed)
    assert parsed[0].request.messages[0].content == "one\u2028two\x85three"


def test_batch_config_checks_its_values():
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        BatchConfig(concurrency=0)
    with pytest.raises(ValueError, match="default_max_tokens must be an integer"):
        BatchConfig(default_max_tokens=0)
    with pytest.raises(ValueError, match="concurrency"):
        BatchJob(object(), concurrency=0)


def test_a_line_the_engine_has_no_room_for_waits_and_is_sent_again(monkeypatch):
    """The job's own lines fill its engine's queue (n choices each): such a line is retried after a
    short wait, as /v1/batches does, instead of being written as a 429."""
    from types import SimpleNamespace

    from mm_pipeline.errors import OverloadedError
    from mm_pipeline.server.batches import lines

    monkeypatch.setattr(lines, "RETRY_FIRST_S", 0.001)
    tries = []

    async def chat(request):
        tries.append(1)
        if len(tries) < 3:
            raise OverloadedError("full")
        return SimpleNamespace(id="chatcmpl-1", model_dump=lambda: {"ok": True})

    job = BatchJob(SimpleNamespace(model_name="m", tokenizer=None))
    job.service = SimpleNamespace(chat=chat)
    line = parse_line(1, json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": "hi"}]}}))
    rec = asyncio.run(job.answer(line))
    assert len(tries) == 3 and rec["response"]["status_code"] == 200 and rec["error"] is None


# ---- resuming: each input line gets exactly one row (a fake ChatService, no model) ----------------------
def _fake_job(hook=None) -> tuple[BatchJob, FakeService]:
    from types import SimpleNamespace

    job = BatchJob(SimpleNamespace(model_name="m", tokenizer=None), concurrency=1)
    job.service = FakeService(hook)
    return job, job.service


def _mixed_batch(path) -> None:
    """Good lines a, b, c, d (1, 3, 5, 7); line 2 has no custom_id, line 4 is not JSON, blank line 6 is none."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text("\n".join([request_line("a", body), json.dumps({"method": "POST", "body": body}),
                               request_line("b", body), "{not json", request_line("c", body), "",
                               request_line("d", body)]) + "\n")


def _rows_per_line(out) -> dict:
    """How many rows each input line has: by custom_id, or by ``error.line`` for a row without one (a
    torn row is none)."""
    from mm_pipeline.jobs.resume import iter_rows

    counts: dict = {}
    for rec in iter_rows(out):
        key = rec["custom_id"] if rec["custom_id"] is not None else rec["error"].get("line")
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_a_rerun_writes_no_row_again_lines_without_a_custom_id_included(tmp_path):
    """A line without a custom_id (none, or not JSON) is known by its line number, which its error row
    names (error.line): a second run finds every line done and leaves the output as it was."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _mixed_batch(src)
    job, service = _fake_job()
    first = asyncio.run(job.run(src, out))
    assert (first.total, first.succeeded, first.failed) == (6, 4, 2)
    written = out.read_bytes()
    again = asyncio.run(job.run(src, out))
    assert (again.skipped, again.succeeded, again.failed) == (6, 0, 0)
    assert out.read_bytes() == written and len(service.started) == 4
    assert len(written.splitlines()) == 6
    assert _rows_per_line(out) == {"a": 1, 2: 1, "b": 1, 4: 1, "c": 1, "d": 1}
    errors = {r["error"]["code"]: r["error"] for r in map(json.loads, written.decode().splitlines()) if r["error"]}
    assert errors["missing_custom_id"]["line"] == 2 and errors["invalid_json"]["line"] == 4


def test_a_line_with_an_id_its_parse_refuses_is_written_once_across_reruns(tmp_path):
    """A lone surrogate escape: the quick read that finds ids sees "a", the full parse refuses the line
    and its error row has no id (error.line): a rerun knows it by that number."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(request_line("a", {"messages": [{"role": "user", "content": "\ud800"}]}) + "\n"
                   + request_line("b", {"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    job, _ = _fake_job()
    asyncio.run(job.run(src, out))
    written = out.read_bytes()
    again = asyncio.run(job.run(src, out))
    assert again.skipped == 2 and out.read_bytes() == written and len(written.splitlines()) == 2


def test_an_interrupted_run_resumed_gives_each_line_exactly_one_row(tmp_path):
    """Stopped while answering line 5 (rows for lines 1-4 written, a torn row after them): the resumed
    run writes lines 5 and 7 only, the error rows of lines 2 and 4 are not written again."""
    class Stop(BaseException):
        pass

    async def stop_at_c(text: str) -> None:
        if len(service.started) == 3:
            raise Stop

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _mixed_batch(src)
    job, service = _fake_job(stop_at_c)
    with pytest.raises(Stop):
        asyncio.run(job.run(src, out))
    assert len(out.read_text().splitlines()) == 4  # lines 1-4
    with out.open("a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "c", "respo')  # the row being written when it stopped
    job, service = _fake_job()
    resumed = asyncio.run(job.run(src, out))
    torn, *rows = out.read_text().splitlines()[4:]  # the torn row, then the resumed run's
    assert torn.endswith('"respo') and [json.loads(r)["custom_id"] for r in rows] == ["c", "d"]
    assert (resumed.total, resumed.skipped, resumed.succeeded, resumed.failed) == (6, 4, 2, 0)
    assert _rows_per_line(out) == {"a": 1, 2: 1, "b": 1, 4: 1, "c": 1, "d": 1}


def test_lines_sharing_a_custom_id_are_refused_before_any_line_runs(tmp_path, capsys, monkeypatch):
    """As /v1/batches validation refuses them: the output keeps one row per custom_id, so a resumed
    run would take the second line for done and lose its answer. A usage error (exit 2) naming the id
    and both lines, before the model loads; BatchJob.run refuses the file before it answers a line."""
    from mm_pipeline import cli

    body = {"messages": [{"role": "user", "content": "hi"}]}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([request_line("a", body), request_line("dup", body), "{not json",
                              request_line("dup", body)]) + "\n")
    monkeypatch.setattr(cli, "load_engine", lambda *a: pytest.fail("the model must not load"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(["batch", "-i", str(src), "-o", str(out), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "line 4: custom_id 'dup' is used by an earlier line (line 2)" in err
    assert not out.exists() or out.read_text() == ""
    job, service = _fake_job()
    with pytest.raises(ValueError, match=r"line 4: custom_id 'dup' .*\(line 2\)"):
        asyncio.run(job.run(src, out))
    assert service.started == [] and out.read_text() == ""
