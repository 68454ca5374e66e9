"""A fake ChatService and batch input files for the batch runner tests (``/v1/batches``,
batches/runner.py, without a model) and the ``mmserve batch`` job's (tests/mm_pipeline/jobs/):
``FakeService`` answers a chat with its first message's text, ``line`` / ``upload`` write a batch's
input file (``request_line``: a line with the body given; ``DEEP_LINE``: one nested too deeply to
parse), ``finished`` waits for a batch to end and ``rows`` reads a result file. The ``store``
fixture (a FilesStore under tmp_path) is in tests/mm_pipeline/server/conftest.py."""

from __future__ import annotations

import asyncio
import json
import time

from mm_pipeline.server.batches.protocol import BatchCreate
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.files.files_store import FilesStore
from mm_pipeline.server.json_limits import JSONLimits

URL = "/v1/chat/completions"
LIMITS = JSONLimits(max_bytes=4096, max_values=1024)


class Answer:
    def __init__(self, text: str) -> None:
        self.id = f"chatcmpl-{text}"

    def model_dump(self) -> dict:
        return {"id": self.id, "choices": [{"message": {"role": "assistant", "content": "ok " * 40}}]}


class FakeService:
    """Answers a chat with its first message's text; ``hook(text)`` runs first (it may raise or wait)."""

    def __init__(self, hook=None) -> None:
        self.hook = hook
        self.started: list[str] = []

    async def chat(self, req) -> Answer:
        text = req.messages[0].content
        self.started.append(text)
        if self.hook is not None:
            await self.hook(text)
        return Answer(text)


def line(cid: str, url: str = URL, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": cid}], **extra}})


def request_line(cid, body, url=URL) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


# a line whose body is nested past any JSON parser's depth: its custom_id cannot be read either
DEEP_LINE = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"


def upload(store: FilesStore, rows: list[str], purpose: str = "batch") -> str:
    return store.put_bytes(("\n".join(rows) + "\n").encode(), "in.jsonl", purpose).id


def create_body(file_id: str, **kw) -> BatchCreate:
    return BatchCreate(input_file_id=file_id, endpoint=URL, completion_window="24h", **kw)


async def until(predicate, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def finished(runner: BatchRunner, batch_id: str):
    await until(lambda: runner.get(batch_id).finished)
    return runner.get(batch_id)


def rows(store: FilesStore, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.path(file_id).read_text().splitlines()]
