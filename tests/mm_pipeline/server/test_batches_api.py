"""OpenAI's Batch API (``/v1/batches``) on the demo checkpoint, served in process: an uploaded batch
file's lines are answered as the chat route answers them (greedy answers equal), 200s in the output
file and the rest in the error file; a file with structural errors fails with the lines named; a
cancelled batch stops, aborts its lines in flight and keeps what was answered; an expired one ends with
its lines not run ``batch_expired`` in its error file, a shut-down one is cancelled with its answered
lines kept; interactive requests are served while a batch runs; the OpenAI SDK drives it all."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from mm_pipeline.server.batches import runner as batch_runner
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]


def line(cid: str, text: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {
        "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, **body}}


def upload(client, lines: list, raw: str | None = None) -> str:
    data = raw if raw is not None else "\n".join(json.dumps(x) for x in lines) + "\n"
    r = client.post("/v1/files", files={"file": ("batch.jsonl", data.encode())}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def create(client, file_id: str, endpoint: str = "/v1/chat/completions") -> dict:
    r = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h",
                                         "metadata": {"job": "test"}})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "batch" and r.json()["status"] == "validating"
    return r.json()


def wait(client, batch_id: str, until=("completed", "failed", "cancelled", "expired"), seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in until:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.get(f"/v1/files/{file_id}/content").text.splitlines()]


def test_a_batch_answers_each_line_as_the_route_does(demo_client):
    texts = [f"Describe shape {i}." for i in range(4)]
    lines = [line(f"r{i}", t) for i, t in enumerate(texts)]
    lines.append({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "x"}})
    batch = wait(demo_client, create(demo_client, upload(demo_client, lines))["id"])
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    assert batch["metadata"] == {"job": "test"} and batch["completed_at"] >= batch["in_progress_at"] > 0
    out = {rec["custom_id"]: rec for rec in jsonl(demo_client, batch["output_file_id"])}
    assert set(out) == {"r0", "r1", "r2", "r3"}
    for i, text in enumerate(texts):
        want = demo_client.post("/v1/chat/completions", json=lines[i]["body"]).json()
        got = out[f"r{i}"]["response"]
        assert got["status_code"] == 200 and got["request_id"] == got["body"]["id"]
        assert got["body"]["choices"][0]["message"] == want["choices"][0]["message"]
    (err,) = jsonl(demo_client, batch["error_file_id"])
    assert err["custom_id"] == "bad-body" and err["response"]["status_code"] == 400
    assert demo_client.get(f"/v1/files/{batch['output_file_id']}").json()["purpose"] == "batch_output"


@pytest.mark.parametrize("lines, raw, code, at", [
    ([line("a", "x"), line("a", "y")], None, "duplicate_custom_id", 2),
    ([line("a", "x"), line("b", "y", url="/v1/completions")], None, "mismatched_url", 2),
    (None, '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n',
     "invalid_json", 2),
    ([{"method": "POST", "url": "/v1/chat/completions", "body": {}}], None, "missing_custom_id", 1),
    ([{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}], None, "invalid_method", 1),
    (None, "\n\n", "empty_file", 0),
])
def test_a_file_with_structural_errors_fails_naming_the_lines(demo_client, lines, raw, code, at):
    batch = wait(demo_client, create(demo_client, upload(demo_client, lines or [], raw))["id"])
    assert batch["status"] == "failed" and batch["failed_at"]
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]][:1] == [(code, at)]
    assert batch["output_file_id"] is None and batch["request_counts"]["completed"] == 0


@pytest.mark.parametrize("body, status, named", [
    ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404, "file-nope"),
    ({"input_file_id": "f", "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400, "endpoint"),
    ({"input_file_id": "f", "endpoint": "/v1/chat/completions", "completion_window": "1h"}, 400, "completion_window"),
    ({"input_file_id": "f", "endpoint": "/v1/chat/completions", "completion_window": "24h",
      "metadata": {"k" * 65: "v"}}, 400, "metadata"),
    ({"input_file_id": "f", "endpoint": "/v1/chat/completions", "completion_window": "24h",
      "metadata": {"k": "v" * 513}}, 400, "metadata"),
])
def test_bad_creates_are_4xx_naming_the_field(demo_client, body, status, named):
    r = demo_client.post("/v1/batches", json=body)
    assert r.status_code == status and named in r.json()["error"]["message"]
    assert demo_client.get("/v1/batches/batch_nope").status_code == 404
    assert demo_client.post("/v1/batches/batch_nope/cancel").status_code == 404


def test_an_input_file_of_another_purpose_is_refused(demo_client):
    data = (json.dumps(line("a", "x")) + "\n").encode()
    r = demo_client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "user_data"})
    r = demo_client.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id" and "batch" in r.text


def test_cancel_stops_aborts_and_keeps_the_answered_lines(demo_client, demo_engine):
    lines = [line(f"r{i}", f"Story {i}.", max_tokens=1500, ignore_eos=True) for i in range(40)]
    batch = create(demo_client, upload(demo_client, lines))
    wait(demo_client, batch["id"], until=("in_progress",))
    # interactive requests are served while the batch runs
    r = demo_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 4})
    assert r.status_code == 200
    steps = demo_engine.stats().engine_loop["steps"]
    cancelling = demo_client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled") and cancelling["cancelling_at"]
    done = wait(demo_client, batch["id"], seconds=30)
    assert done["status"] == "cancelled" and done["cancelled_at"]
    assert done["request_counts"]["completed"] < 40
    deadline = time.monotonic() + 10
    while demo_engine.requests_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert demo_engine.stats().engine_loop["steps"] - steps < 1000  # lines in flight aborted, not run to 1,500 tokens
    again = demo_client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 409 and "cancelled" in again.json()["error"]["message"]
    listed = demo_client.get("/v1/batches", params={"limit": 2}).json()
    assert listed["data"][0]["id"] == batch["id"] and listed["has_more"] and len(listed["data"]) == 2
    after = demo_client.get("/v1/batches", params={"limit": 100, "after": batch["id"]}).json()
    assert batch["id"] not in [b["id"] for b in after["data"]]


def test_an_expired_batch_ends_without_running(demo_client, monkeypatch):
    monkeypatch.setattr(batch_runner, "WINDOW_S", 0)
    batch = wait(demo_client, create(demo_client, upload(demo_client, [line("a", "x"), line("b", "y")]))["id"])
    assert batch["status"] == "expired" and batch["expired_at"] and batch["output_file_id"] is None
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert [(r["custom_id"], r["error"]["code"]) for r in jsonl(demo_client, batch["error_file_id"])] == [
        ("a", "batch_expired"), ("b", "batch_expired")]


def test_a_shutdown_cancels_the_running_batch_and_keeps_its_answered_lines(demo_engine, tmp_path):
    app = create_app(demo_engine, ServerSettings(files_dir=str(tmp_path)))
    with ServerThread(app) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            fid = upload(c, [line("short", "Hi.", max_tokens=2)] + [
                line(f"r{i}", "Story.", max_tokens=1500, ignore_eos=True) for i in range(8)])
            batch = create(c, fid)
            deadline = time.monotonic() + 30
            while c.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    ended = app.state.batches.get(batch["id"])
    assert ended.status == "cancelled" and ended.errors.data[0].code == "server_shutdown" and ended.cancelled_at
    assert ended.request_counts.completed == 1 and ended.request_counts.total == 9
    kept = app.state.store.path(ended.output_file_id).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in kept] == ["short"]
    deadline = time.monotonic() + 10
    while demo_engine.requests_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_openai_sdk_runs_a_batch(demo_client):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(demo_client.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0)
    data = "\n".join(json.dumps(line(f"q{i}", f"Name colour {i}.")) for i in range(3)).encode()
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["q0", "q1", "q2"]
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
