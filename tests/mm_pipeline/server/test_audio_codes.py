"""Pre-tokenized audio codes through the HTTP API and batch files (issue 23), on a tiny checkpoint
in the MiMo-V2.5 reference layout (4 RVQ stages with codebooks 16, 16, 8, 8; 25 code frames a
second): the codes give the tokens of the audio they are the codes of, streamed or not, and every
malformed or hostile codes part is a 4xx with a message, bounded in time and memory."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from mm_pipeline.jobs.batch import BatchJob
from mm_pipeline.media.ingest_config import MediaLimits
from samples.synthetic.hostile_media import measured
from tests.support.audio_codes import tokenizer_codes
from tests.support.media_samples import audio_bytes
from tests.support.served import served_tiny_omni, wait_idle

pytestmark = pytest.mark.usefixtures("one_thread")
CLIP = audio_bytes(seconds=3.0, rate=16000, channels=1, freq=300.0)
MAX_SECONDS = 5.0  # the served duration limit: 125 code frames


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_omni(tmp_path_factory, audio_path="reference", num_full_tokens=4096, num_swa_tokens=1024,
                          max_num_seqs=4, max_model_len=512,
                          limits=MediaLimits(max_duration_s=MAX_SECONDS)) as server:
        yield server


@pytest.fixture(scope="module")
def codes(served) -> list[list[int]]:
    """What the checkpoint's tokenizer makes of CLIP, [channels][frames] (segment by segment)."""
    return tokenizer_codes(served.engine.runtime, CLIP).tolist()


def codes_part(codes, **extra) -> dict:
    return {"type": "input_audio_codes", "input_audio_codes": {"codes": codes, "format": "mimo_rvq", **extra}}


def audio_part() -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(CLIP).decode(), "format": "wav"}}


def body(part: dict, **fields) -> dict:
    return {"max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}], **fields}


def post(server, payload, **kw) -> httpx.Response:
    send = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                      headers={"content-type": "application/json"}, **send, **kw)


def streamed_text(server, payload: dict) -> str:
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**payload, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def test_codes_answer_as_their_audio_does(served, codes):
    assert len(codes) == 4 and len(codes[0]) == 3 * 24 + 4
    by_audio = post(served, body(audio_part())).json()
    by_codes = post(served, body(codes_part(codes))).json()
    assert "choices" in by_codes, by_codes
    assert by_codes["choices"][0]["message"]["content"] == by_audio["choices"][0]["message"]["content"]
    assert by_codes["usage"]["prompt_tokens"] == by_audio["usage"]["prompt_tokens"]
    encoded = served.engine.stats().encoder["encoded.audio"]

    # streamed, and again: every segment from the encoder cache, nothing encoded
    assert streamed_text(served, body(codes_part(codes))) == by_audio["choices"][0]["message"]["content"]
    assert served.engine.stats().encoder["encoded.audio"] == encoded


def test_batch_file_lines_take_codes(served, codes, tmp_path):
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": body(part)}
             for name, part in (("audio", audio_part()), ("codes", codes_part(codes)),
                                ("bad", codes_part([row[:10] for row in codes[:3]])))]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = asyncio.run(BatchJob(served.engine).run(src, out))
    assert (summary.succeeded, summary.failed) == (2, 1)
    recs = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    answer = [recs[n]["body"]["choices"][0]["message"]["content"] for n in ("audio", "codes")]
    assert answer[0] == answer[1]
    assert recs["bad"]["status_code"] == 400 and "3 channels" in recs["bad"]["body"]["error"]["message"]


def _bad_codes(codes):
    big = [row * 2 for row in codes]  # 152 frames: over the 5 s limit (125)
    out_of_range = [list(row) for row in codes]
    out_of_range[2][7] = 8  # stage 2's codebook has 8 entries
    top = [list(row) for row in codes]
    top[0][0] = 16
    return [
        (codes[:3], 400, "3 channels; this model reads 4 RVQ stages"),
        (codes + [codes[0]], 400, "5 channels"),
        (out_of_range, 400, ", 8]; its codebook has 8 entries (0..7)"),
        (top, 400, "channel 0 span"),
        ([codes[0], codes[1][:-1], codes[2], codes[3]], 400, "ragged: channel 0 has 76 frames, channel 1 has 75"),
        ([[1.5] + r[1:] for r in codes], 400, "valid integer"),
        ([[1.0] + r[1:] for r in codes], 400, "valid integer"),
        ([[True] + r[1:] for r in codes], 400, "valid integer"),
        ([["3"] + r[1:] for r in codes], 400, "valid integer"),
        ([[None] + r[1:] for r in codes], 400, "valid integer"),
        ([[-1] + r[1:] for r in codes], 400, "greater than or equal to 0"),
        ([[2**40] + r[1:] for r in codes], 400, "less than or equal to 2147483647"),
        ([[[1]] + r[1:] for r in codes], 400, "valid integer"),
        ([], 400, "at least 1 item"),
        ([[], [], [], []], 400, "non-empty list"),
        ([[0]] * 65, 400, "at most 64 items"),
        ("AAAA", 400, "valid array"),
        (big, 413, "152 frames (6.1 s at 25 frames/s), over the 5 s limit (max_duration_s)"),
    ]


def test_malformed_codes_are_4xx_with_a_message(served, codes):
    for bad, status, message in _bad_codes(codes):
        r = post(served, body(codes_part(bad)))
        assert r.status_code == status, (message, r.text[:300])
        assert message in r.json()["error"]["message"], r.text[:300]
    r = post(served, body(codes_part(codes, format="encodec")))
    assert r.status_code == 400 and "mimo_rvq" in r.json()["error"]["message"]
    r = post(served, body({"type": "input_audio_codes", "input_audio_codes": [codes]}))
    assert r.status_code == 400
    deep = json.dumps(body(codes_part("X"))).replace('"X"', "[" * 100_000 + "]" * 100_000).encode()
    r = post(served, deep)  # nesting: the parser's recursion limit, not the interpreter's stack
    assert r.status_code == 400 and "recursion limit" in r.json()["error"]["message"]
    assert post(served, body(codes_part(codes))).status_code == 200  # and the server goes on
    wait_idle(served)


def test_a_body_of_millions_of_numbers_is_refused_before_it_is_parsed(served):
    """4.5M codes in 23 MB of JSON: parsed, they would take ~300 MB (a Python int and a list slot
    each, and the parser's own tree); the value cap refuses them from a count of the raw bytes."""
    n = 4_500_000
    raw = (b'{"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "input_audio_codes", '
           b'"input_audio_codes": {"codes": [[' + b"1023," * (n - 1) + b'1023]]}}]}]}')
    try:
        r, seconds, grown_mb = measured(lambda: post(served, raw))
    except OSError:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs)")
    assert r.status_code == 413 and "over the limit of 4000000 (max_json_values)" in r.json()["error"]["message"]
    # the body itself is held twice (the read buffer and its bytes copy) on the server and once by
    # the client, all in this process
    assert grown_mb < 3 * len(raw) / 2**20 + 40, grown_mb
    assert seconds < 5.0


def test_a_model_without_the_reference_audio_path_refuses_codes(tmp_path_factory):
    with served_tiny_omni(tmp_path_factory, num_full_tokens=1024, num_swa_tokens=512, max_num_seqs=1) as server:
        r = post(server, body(codes_part([[1, 2, 3, 4]] * 4)))
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "need the MiMo-V2.5 reference audio path" in message and "input_audio" in message
