"""The ingress's uploads (mm_pipeline/cluster/serving/remote_engine.py ``_files``): a chat's media
item count and each uploaded file's size are checked against the replicas' limits before any file is
read into the ingress's memory -- with or without an encoder tier, for chat and /tokenize alike, with
the statuses a single process answers (400 too many items, 413 a file over max_bytes). The LLM
deployment's handle is a stand-in."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")  # RemoteEngine names Ray's error types

from llm_core.engine.sampling import SamplingParams  # noqa: E402
from mm_pipeline.cluster.serving.remote_engine import RemoteEngine  # noqa: E402
from mm_pipeline.media.ingest_config import MediaLimits  # noqa: E402


class _Done:
    finished = True
    new_text = ""

    def __aiter__(self) -> "_Done":
        self.sent = False
        return self

    async def __anext__(self) -> "_Done":
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        return self

    def cancel(self) -> None:
        pass


class Handle:
    """The LLM deployment: records the files each call carried."""

    def __init__(self) -> None:
        self.files: list[dict] = []

    def options(self, **_: Any) -> "Handle":
        return self

    @property
    def generate(self) -> "Handle":
        return self

    def remote(self, kind: str, payload: Any, params: Any, request_id: Any, files: dict, **_: Any) -> _Done:
        self.files.append(files)
        return _Done()


def chat(*ids: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "file", "file": {"file_id": i}} for i in ids]}]


@pytest.fixture
def uploads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Path], list[str]]:
    """Files f0..f2 of 10 bytes and big of 100, and the names of those read (any way a Path reads)."""
    paths = {f"f{i}": tmp_path / f"f{i}" for i in range(3)} | {"big": tmp_path / "big"}
    for fid, p in paths.items():
        p.write_bytes(b"x" * (100 if fid == "big" else 10))
    read: list[str] = []
    real_open, real_read = Path.open, Path.read_bytes

    def note(path: Path) -> None:
        if path in paths.values():
            read.append(path.name)

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: (note(self), real_open(self, *a, **k))[1])
    monkeypatch.setattr(Path, "read_bytes", lambda self: (note(self), real_read(self))[1])
    return paths, read


def engine_of(paths: dict[str, Path]) -> tuple[RemoteEngine, Handle]:
    handle = Handle()
    engine = RemoteEngine(handle, None, "m", limits=MediaLimits(max_media_items=2, max_bytes=50))
    engine.set_file_resolver(lambda fid: (paths[fid], fid))
    return engine, handle


async def run_chat(engine: RemoteEngine, messages: list[dict]) -> None:
    async for _ in engine.generate(messages, SamplingParams(max_tokens=1)):
        pass


def test_limits_are_checked_before_any_upload_is_read(uploads):
    """Without an encoder tier too: 40 uploads of 150 MiB were read (6 GiB) before a replica refused them."""
    from mm_pipeline.errors import InvalidInputError, MediaTooLarge

    paths, read = uploads
    engine, handle = engine_of(paths)
    with pytest.raises(InvalidInputError, match="3 media items, limit 2"):
        asyncio.run(run_chat(engine, chat("f0", "f1", "f2")))
    with pytest.raises(MediaTooLarge, match="'big' is 100 bytes, over the 50-byte"):
        asyncio.run(run_chat(engine, chat("f0", "big")))
    with pytest.raises(InvalidInputError, match="3 media items"):
        asyncio.run(engine.prompt_token_ids(messages=chat("f0", "f1", "f2")))
    assert read == [] and handle.files == []
    asyncio.run(run_chat(engine, chat("f0", "f1")))  # within the limits: read and sent
    assert sorted(read) == ["f0", "f1"] and {fid: f.data for fid, f in handle.files[0].items()} == {
        "f0": b"x" * 10, "f1": b"x" * 10}


def test_the_http_statuses_are_a_single_process_ones(uploads):
    from fastapi.testclient import TestClient

    from mm_pipeline.server.app import create_app
    from mm_pipeline.server.settings import ServerSettings

    paths, read = uploads
    engine, handle = engine_of(paths)
    with TestClient(create_app(engine, ServerSettings(model_name="m"))) as client:
        engine.set_file_resolver(lambda fid: (paths[fid], fid))  # the app set its own store's
        body = {"model": "m", "max_tokens": 1}
        r = client.post("/v1/chat/completions", json=body | {"messages": chat("f0", "f1", "f2")})
        assert r.status_code == 400 and "max_media_items" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json=body | {"messages": chat("big")})
        assert r.status_code == 413 and "max_bytes" in r.json()["error"]["message"]
    assert read == [] and handle.files == []
