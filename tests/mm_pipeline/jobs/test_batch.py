"""``mmserve batch`` over the tiny omni model: OpenAI Batch input lines in, OpenAI Batch output lines out.

Proves: valid chat and completion lines answer 200 with the same body the server would give
(greedy: same text as a direct ChatService call), sampling fields and structured outputs included;
HTTP-level failures (bad media, bad fields) carry their status and OpenAI error body in
``response``; lines that are not requests get ``response: null`` and ``error`` (naming the line);
a re-run after a torn last row writes each line once; the CLI's usage errors come before the model
loads. The lines and their rows without a model are test_batch_lines.py's.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from mm_pipeline.jobs.batch import BatchJob

from tests.support.batches import DEEP_LINE, request_line
from tests.support.paths import SAMPLE_MEDIA as MEDIA  # noqa: E402


def _image_msg(name: str, prompt: str = "Describe this image.") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode((MEDIA / name).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": prompt}]}]


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
        request_line("img", {"model": "x", "messages": _image_msg("image_000001.png"), "max_tokens": 5,
                             "temperature": 0}),
        request_line("aud", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}], "max_tokens": 3}),
        request_line("cmp", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logprobs": 1},
                     url="/v1/completions"),
        request_line("415", {"messages": _image_msg("audio_000003.wav")}),
        request_line("400", {"messages": [], "max_tokens": 2}),
        "{broken json",
        request_line("url", {"messages": []}, url="/v1/embeddings"),
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
    lines = [request_line("pen", body, url="/v1/completions"),
             request_line("vocab", {**body, "logit_bias": {"100000000": 1}}, url="/v1/completions"),
             request_line("range", {**body, "presence_penalty": 3}, url="/v1/completions")]
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
    lines = [request_line("choice", {**chat, "structured_outputs": {"choice": ["red", "blue"]}}),
             request_line("regex", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                             "structured_outputs": {"regex": "[a-c]{2}"}}, url="/v1/completions"),
             request_line("bad", {**chat, "structured_outputs": {"regex": "(ab"}}),
             request_line("two", {**chat, "response_format": {"type": "json_object"}, "guided_regex": "a"})]
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
    ok = [request_line(c, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) for c in ("a", "b")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes("\n".join([ok[0], ok[1], DEEP_LINE]).encode() + b"\n{\"custom_id\": \"\xff\"}\n")
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
    src.write_text(request_line("t", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n")
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
    src.write_text(request_line("t", {"messages": []}) + "\n")
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
