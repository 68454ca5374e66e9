"""``mmserve batch``: OpenAI Batch input lines in, OpenAI Batch output lines out (tiny omni model).

Proves: valid chat and completion lines answer 200 with the same body the server would give
(greedy: same text as a direct ChatService call); HTTP-level failures (bad media, bad fields) carry
their status and OpenAI error body in ``response``; lines that are not requests (bad JSON, no
custom_id, unsupported url) get ``response: null`` and ``error`` (naming the line); a re-run skips
done lines, by custom_id or, for a line without one, by its line number; lines sharing a custom_id
are refused before any runs.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from mm_pipeline.jobs.batch import BatchConfig, BatchJob
from mm_pipeline.server.batches.lines import custom_id_of, input_lines, parse_line

from tests.support.batches import FakeService
from tests.support.paths import SAMPLE_MEDIA as MEDIA  # noqa: E402


def _line(cid, body, url="/v1/chat/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _image_msg(name: str, prompt: str = "Describe this image.") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode((MEDIA / name).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": prompt}]}]


def test_parse_line_classifies_without_raising():
    assert parse_line(1, "{not json").problem[1] == "invalid_json"
    assert parse_line(2, "[1]").problem[1] == "invalid_request"
    assert parse_line(3, json.dumps({"url": "/v1/chat/completions", "body": {}})).problem[1] == "missing_custom_id"
    assert parse_line(4, _line("a", {}, url="/v1/embeddings")).problem[1] == "invalid_url"
    bad = parse_line(5, _line("b", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}))
    assert bad.problem[0] == 400 and "temperature" in bad.problem[2]
    ok = parse_line(6, _line("c", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}))
    assert ok.problem is None and ok.request.model is None  # the model field is ignored offline


DEEP = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"


def test_lines_that_are_not_utf8_or_too_deep_are_error_rows_not_a_crash(tmp_path):
    bad = _line("caf\u00e9", {}).encode().replace("caf\\u00e9".encode(), b"caf\xe9")
    assert bad.count(b"\xe9") == 1
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([_line("a", {}).encode(), bad, DEEP.encode(), b"1" * 5000, _line("b", {}).encode()]))
    lines = list(input_lines(src))  # decoded a line at a time: the bad byte does not end the file
    assert [(n, cid) for n, _, cid in lines] == [(1, "a"), (2, None), (3, None), (4, None), (5, "b")]
    assert lines[1][1] == bad + b"\n" and custom_id_of(DEEP) is None
    problems = [parse_line(n, raw).problem for n, raw, _ in lines[1:4]]
    assert [p[1] for p in problems] == ["invalid_json"] * 3
    assert "line 2: not UTF-8" in problems[0][2] and "nested too deeply" in problems[1][2]
    assert "line 4: not JSON" in problems[2][2]  # an integer longer than int() takes


def test_input_lines_split_on_newlines_only(tmp_path):
    """CRLF line ends and a last line without its newline are lines like any other; U+2028 and U+0085
    inside a JSON string (written raw, as ensure_ascii=False writes them) do not end a line."""
    body = {"messages": [{"role": "user", "content": "one\u2028two\x85three"}]}
    lines = [json.dumps({"custom_id": "a\u2028b", "method": "POST", "url": "/v1/chat/completions", "body": body},
                        ensure_ascii=False), "", _line("c", body)]
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
    path.write_text("\n".join([_line("a", body), json.dumps({"method": "POST", "body": body}), _line("b", body),
                               "{not json", _line("c", body), "", _line("d", body)]) + "\n")


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
    src.write_text(_line("a", {"messages": [{"role": "user", "content": "\ud800"}]}) + "\n"
                   + _line("b", {"messages": [{"role": "user", "content": "hi"}]}) + "\n")
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
    src.write_text("\n".join([_line("a", body), _line("dup", body), "{not json", _line("dup", body)]) + "\n")
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


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.runtime.config import OmniEngineConfig

    model_dir = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "tiny-omni", seed=0)
    eng = OmniEngine.from_pretrained(model_dir, OmniEngineConfig.from_kwargs(num_full_tokens=4096))
    yield eng
    eng.shutdown()


def test_batch_file_roundtrip(engine, tmp_path):
    wav = base64.b64encode((MEDIA / "audio_000003.wav").read_bytes()).decode()
    lines = [
        _line("img", {"model": "x", "messages": _image_msg("image_000001.png"), "max_tokens": 5, "temperature": 0}),
        _line("aud", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}], "max_tokens": 3}),
        _line("cmp", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logprobs": 1}, url="/v1/completions"),
        _line("415", {"messages": _image_msg("audio_000003.wav")}),
        _line("400", {"messages": [], "max_tokens": 2}),
        "{broken json",
        _line("url", {"messages": []}, url="/v1/embeddings"),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    summary = asyncio.run(BatchJob(engine, concurrency=4).run(src, out))
    assert (summary.total, summary.succeeded, summary.failed) == (7, 3, 4)
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in recs}
    assert len(recs) == 7 and all(r["id"].startswith("batch_req_") for r in recs)
    img = by_id["img"]["response"]
    assert img["status_code"] == 200 and img["body"]["object"] == "chat.completion"
    assert img["request_id"] == img["body"]["id"] and img["body"]["usage"]["completion_tokens"] <= 5
    assert by_id["img"]["error"] is None
    assert by_id["aud"]["response"]["status_code"] == 200
    cmp_ = by_id["cmp"]["response"]["body"]
    assert cmp_["object"] == "text_completion" and len(cmp_["choices"][0]["logprobs"]["tokens"]) == \
        cmp_["usage"]["completion_tokens"]
    assert by_id["415"]["response"]["status_code"] == 415
    assert by_id["415"]["response"]["body"]["error"]["type"] == "unsupported_media_type"
    assert by_id["415"]["response"]["body"]["error"]["kind"] == "media"
    assert by_id["400"]["response"]["status_code"] == 400 and "messages" in by_id["400"]["response"]["body"]["error"]["message"]
    assert by_id["400"]["response"]["body"]["error"]["kind"] == "invalid_input"  # a bad message is not bad media
    assert by_id["url"]["response"] is None and by_id["url"]["error"]["code"] == "invalid_url"
    broken = by_id[None]
    assert broken["response"] is None and broken["error"]["code"] == "invalid_json"

    # greedy: the batch answer is what a direct call answers
    from mm_pipeline.server.completions.chat_service import ChatService, ServiceConfig
    from mm_pipeline.server.protocol import ChatCompletionRequest

    direct = asyncio.run(ChatService(engine, ServiceConfig(engine.model_name)).chat(ChatCompletionRequest(
        messages=_image_msg("image_000001.png"), max_tokens=5, temperature=0)))
    assert direct.choices[0].message.content == img["body"]["choices"][0]["message"]["content"]

    # re-run: every line is done, the broken one without a custom_id by its line (error.line)
    assert broken["error"]["line"] == 6
    again = asyncio.run(BatchJob(engine).run(src, out))
    assert again.skipped == 7 and again.failed == 0
    assert len(out.read_text().splitlines()) == 7


def test_batch_lines_take_penalties_logit_bias_min_p_and_min_tokens(engine, tmp_path):
    sampling = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 0.5, "min_p": 0.1,
                "min_tokens": 4, "logit_bias": {"5": -100, "9": 3}}
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, **sampling}
    lines = [_line("pen", body, url="/v1/completions"),
             _line("vocab", {**body, "logit_bias": {"100000000": 1}}, url="/v1/completions"),
             _line("range", {**body, "presence_penalty": 3}, url="/v1/completions")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    summary = asyncio.run(BatchJob(engine, concurrency=3).run(src, out))
    assert (summary.total, summary.succeeded, summary.failed) == (3, 1, 2)
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    pen = by_id["pen"]
    assert pen["status_code"] == 200 and pen["body"]["usage"]["completion_tokens"] == 4  # min_tokens = max_tokens
    for cid, field in (("vocab", "logit_bias"), ("range", "presence_penalty")):
        assert by_id[cid]["status_code"] == 400 and field in by_id[cid]["body"]["error"]["message"], by_id[cid]
    assert by_id["range"]["body"]["error"]["param"] == "presence_penalty"  # as the route names it

    from mm_pipeline.server.completions.chat_service import ChatService, ServiceConfig
    from mm_pipeline.server.protocol import CompletionRequest

    direct = asyncio.run(ChatService(engine, ServiceConfig(engine.model_name)).complete(CompletionRequest(**body)))
    assert direct.choices[0].text == pen["body"]["choices"][0]["text"]


def test_batch_lines_take_structured_outputs(engine, tmp_path):
    """A line's response_format / structured_outputs hold its answer as the server's would; a bad
    constraint is that line's 400 and the others go on."""
    chat = {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 12, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    lines = [_line("choice", {**chat, "structured_outputs": {"choice": ["red", "blue"]}}),
             _line("regex", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                             "structured_outputs": {"regex": "[a-c]{2}"}}, url="/v1/completions"),
             _line("bad", {**chat, "structured_outputs": {"regex": "(ab"}}),
             _line("two", {**chat, "response_format": {"type": "json_object"}, "guided_regex": "a"})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    summary = asyncio.run(BatchJob(engine, concurrency=4).run(src, out))
    assert (summary.total, summary.succeeded, summary.failed) == (4, 2, 2)
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["choice"]["body"]["choices"][0]["message"]["content"] in ("red", "blue")
    assert len(by_id["regex"]["body"]["choices"][0]["text"]) == 2
    assert set(by_id["regex"]["body"]["choices"][0]["text"]) <= set("abc")
    assert by_id["bad"]["status_code"] == 400 and "structured_outputs.regex" in by_id["bad"]["body"]["error"]["message"]
    assert by_id["two"]["status_code"] == 400 and "one structured output" in by_id["two"]["body"]["error"]["message"]


def test_batch_resume_after_a_torn_line_and_bad_lines(engine, tmp_path):
    """A crash left a torn last line: the next row starts on a line of its own (it was glued onto
    it, so lost while reported done); a line that is not UTF-8 or too deep is an error row."""
    ok = [_line(c, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) for c in ("a", "b")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes("\n".join([ok[0], ok[1], DEEP]).encode() + b"\n{\"custom_id\": \"\xff\"}\n")
    out.write_text('{"id": "x", "custom_id": "a", "response": {"status_c')
    summary = asyncio.run(BatchJob(engine, concurrency=2).run(src, out))
    assert (summary.total, summary.succeeded, summary.failed) == (4, 2, 2)
    torn, *rows = out.read_text().splitlines()
    recs = [json.loads(r) for r in rows]  # every row after the torn line is whole
    assert sorted(str(r["custom_id"]) for r in recs) == ["None", "None", "a", "b"]
    assert sorted(r["error"]["message"] for r in recs if r["error"]) == ["line 3: not JSON (nested too deeply)",
                                                                         "line 4: not UTF-8 (invalid start byte at byte 15)"]
    again = asyncio.run(BatchJob(engine).run(src, out))
    assert again.skipped == 4 and again.succeeded == again.failed == 0  # a, b and the lines 3 and 4 are done


def test_batch_cli(engine, tmp_path, capsys, monkeypatch):
    from mm_pipeline import cli

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(_line("t", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n")
    monkeypatch.setattr(cli, "load_engine", lambda args, model_dir: _Borrowed(engine))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(["batch", "-i", str(src), "-o", str(out), "--model", str(model)]) == 0
    rec = json.loads(out.read_text())
    assert rec["custom_id"] == "t" and rec["response"]["status_code"] == 200
    assert "1 succeeded" in capsys.readouterr().err
    assert cli.main(["batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    new = tmp_path / "new" / "dir" / "out.jsonl"  # its directory is made, as caption makes its --out's
    assert cli.main(["batch", "-i", str(src), "-o", str(new), "--model", str(model)]) == 0
    assert json.loads(new.read_text())["custom_id"] == "t"


def test_batch_cli_usage_errors_come_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from mm_pipeline import cli
    from mm_pipeline.jobs.resume import open_output

    monkeypatch.setattr(cli, "load_engine", lambda *a: pytest.fail("the model must not load"))
    src, model = tmp_path / "in.jsonl", tmp_path / "m"
    src.write_text(_line("t", {"messages": []}) + "\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["batch", "-i", str(src), "--model", str(model)]

    def rc(*argv: str) -> int:
        try:
            return cli.main([*base, *argv])
        except SystemExit as exc:  # argparse's usage errors
            return exc.code

    assert rc("-o", "o.jsonl", "--concurrency", "0") == 2
    assert "argument --concurrency: concurrency must be >= 1" in capsys.readouterr().err
    assert rc("-o", "o.jsonl", "--default-max-tokens", "0") == 2  # else every line without max_tokens fails
    assert "argument --default-max-tokens: default_max_tokens must be" in capsys.readouterr().err
    assert rc("-o", str(tmp_path)) == 2 and "Is a directory" in capsys.readouterr().err
    assert rc("-o", str(src)) == 2 and "the output is the input file" in capsys.readouterr().err
    with open_output(tmp_path / "busy.jsonl"):  # another job writes it
        assert rc("-o", str(tmp_path / "busy.jsonl")) == 2
    assert "being written by another job" in capsys.readouterr().err


class _Borrowed:
    """The module's engine, lent to the CLI without letting it shut the engine down."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shutdown(self) -> None:
        pass
