"""``mmserve batch``: OpenAI Batch input lines in, OpenAI Batch output lines out (tiny omni model).

Proves: valid chat and completion lines answer 200 with the same body the server would give
(greedy: same text as a direct ChatService call); HTTP-level failures (bad media, bad fields) carry
their status and OpenAI error body in ``response``; lines that are not requests (bad JSON, no
custom_id, unsupported url) get ``response: null`` and ``error``; a re-run skips done custom_ids.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from mm_pipeline.jobs.batch import BatchJob, parse_line

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
    from mm_pipeline.server.chat_service import ChatService, ServiceConfig
    from mm_pipeline.server.protocol import ChatCompletionRequest

    direct = asyncio.run(ChatService(engine, ServiceConfig(engine.model_name)).chat(ChatCompletionRequest(
        messages=_image_msg("image_000001.png"), max_tokens=5, temperature=0)))
    assert direct.choices[0].message.content == img["body"]["choices"][0]["message"]["content"]

    # re-run: finished custom_ids are skipped; the unnamed broken line is reported again
    again = asyncio.run(BatchJob(engine).run(src, out))
    assert again.skipped == 6 and again.failed == 1
    assert len(out.read_text().splitlines()) == 8


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


class _Borrowed:
    """The module's engine, lent to the CLI without letting it shut the engine down."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shutdown(self) -> None:
        pass
