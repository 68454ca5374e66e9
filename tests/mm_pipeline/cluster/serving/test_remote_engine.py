"""The ingress's engine (mm_pipeline/cluster/serving/remote_engine.py) and the route key it builds,
without a cluster (the DeploymentHandle is a stand-in):

* a replica whose engine stopped answers with ``EngineStopped``: the request is resent, naming that
  replica for the router to skip, and the client sees nothing;
* the route key is built off the event loop (test_route_key.py: in linear time, from a bounded
  prefix of the prompt);
* ``stats()`` (what /health reads) stops serving an old snapshot once no replica has answered for
  ``STATS_STALE_S`` (503), and a refresh that hangs times out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")  # RemoteEngine names Ray's error types

from llm_core.engine.sampling import SamplingParams  # noqa: E402
from mm_pipeline.cluster.serving import llm_replica, remote_engine  # noqa: E402
from mm_pipeline.cluster.serving.llm_replica import ReplicaFailure  # noqa: E402
from mm_pipeline.cluster.serving.remote_engine import RemoteEngine  # noqa: E402
from mm_pipeline.errors import ServerBusy  # noqa: E402
from tests.support.paths import DEMO_MODEL  # noqa: E402
from tests.support.serve_broadcast import SILENT, Broadcast  # noqa: E402


class _Stream:
    """A streaming DeploymentResponseGenerator: yields its items, raises the exceptions among them."""

    def __init__(self, items: list[Any]) -> None:
        self.items = iter(items)
        self.cancelled = False

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        item = next(self.items, StopAsyncIteration)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """The LLM deployment's handle: each ``generate`` call answers with the next script."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.calls: list[dict[str, Any]] = []

    def options(self, **_: Any) -> "Handle":
        return self

    @property
    def generate(self) -> "Handle":
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Stream:
        self.calls.append(kwargs)
        return _Stream(self.scripts.pop(0))


def delta(finished: bool) -> SimpleNamespace:
    return SimpleNamespace(finished=finished, new_text="x")


async def collect(gen) -> list[Any]:
    return [item async for item in gen]


# ---- a replica whose engine stopped ---------------------------------------------------------------

def test_a_stopped_engine_is_resent_to_another_replica():
    """The replica's engine died (a TP rank): every request it got failed with a plain RuntimeError,
    a 500 with no resend, and the router kept choosing it (load 0, best prefix match)."""
    stopped = ReplicaFailure(llm_replica.EngineStopped("the LLM replica's engine stopped: rank 1 exited", "replica-0"))
    handle = Handle([stopped], [delta(False), delta(True)])
    engine = RemoteEngine(handle, None, "m")
    out = asyncio.run(collect(engine.generate_prompt([1, 2, 3], SamplingParams(max_tokens=2))))
    assert [d.finished for d in out] == [False, True] and engine.resends == 1
    assert handle.calls[0]["avoid"] == () and handle.calls[1]["avoid"] == ("replica-0",)


def test_the_priority_reaches_the_replica_on_every_send():
    stopped = ReplicaFailure(llm_replica.EngineStopped("the LLM replica's engine stopped", "replica-0"))
    handle = Handle([stopped], [delta(True)], [delta(True)])
    engine = RemoteEngine(handle, None, "m")
    asyncio.run(collect(engine.generate_prompt([1, 2, 3], SamplingParams(max_tokens=2), priority=-4)))
    asyncio.run(collect(engine.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))))
    assert [c["priority"] for c in handle.calls] == [-4, -4, 0]  # the resend keeps it; the default is 0


def test_the_cache_salt_reaches_the_replica_and_seeds_the_route_key():
    handle = Handle([delta(True)], [delta(True)])
    engine = RemoteEngine(handle, None, "m")
    asyncio.run(collect(engine.generate_prompt([1] * 40, SamplingParams(max_tokens=1), cache_salt="t-1")))
    asyncio.run(collect(engine.generate_prompt([1] * 40, SamplingParams(max_tokens=1))))
    assert [c["cache_salt"] for c in handle.calls] == ["t-1", None]
    salted, plain = (c["route"] for c in handle.calls)
    assert salted.weights == plain.weights and not set(salted.hashes) & set(plain.hashes)


def test_an_encoder_tier_gets_one_flow_and_the_priority_per_request():
    """With an encoder tier each media item is its own encode call; they all carry the request's
    flow and priority, so a request of many items takes one turn per round on the replicas' queues
    (media/flows.py) and an urgent request stays urgent there."""
    calls: list[dict[str, Any]] = []

    class Encoders:
        @property
        def encode(self) -> "Encoders":
            return self

        def remote(self, *args: Any, **kwargs: Any):
            calls.append(kwargs)
            done = asyncio.get_running_loop().create_future()
            done.set_result(SimpleNamespace(units=1, hits=0, replica="e0"))
            done.cancel = lambda: None
            return done

    engine = RemoteEngine(Handle([delta(True)], [delta(True)]), None, "m", encoders=Encoders())
    items = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{k}AAA="}} for k in "ABC"]
    messages = [{"role": "user", "content": [*items, {"type": "text", "text": "hi"}]}]
    asyncio.run(collect(engine.generate(messages, SamplingParams(max_tokens=1), request_id="req-7", priority=-2)))
    assert len(calls) == 3 and {(c["flow"], c["priority"]) for c in calls} == {("req-7", -2)}
    calls.clear()
    asyncio.run(collect(engine.generate(messages, SamplingParams(max_tokens=1))))  # no id: one of its own
    assert len({c["flow"] for c in calls}) == 1 and calls[0]["flow"] and calls[0]["priority"] == 0


def test_a_stopped_engine_after_the_first_token_ends_with_a_503():
    stopped = ReplicaFailure(llm_replica.EngineStopped("the LLM replica's engine stopped", "replica-0"))
    engine = RemoteEngine(Handle([delta(False), stopped]), None, "m")
    with pytest.raises(ServerBusy):  # a resend would repeat the text already sent
        asyncio.run(collect(engine.generate_prompt([1, 2, 3], SamplingParams(max_tokens=2))))
    assert engine.resends == 0


# ---- the route key --------------------------------------------------------------------------------

@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing")
def test_the_route_key_is_built_off_the_event_loop(monkeypatch):
    """A 100k-character prompt held the ingress's loop ~0.7 s (tokenizing and hashing on it; 25 s at
    500k characters): every other request, stream and /health of that ingress waited. The proof is
    where the tokenizer runs (a thread that is not the loop's), not a timing."""
    from llm_core.llm import load_tokenizer

    handle = Handle([delta(True)], [delta(True)])
    engine = RemoteEngine(handle, load_tokenizer(str(DEMO_MODEL)), "m")
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 1600
    encode, threads = engine._encode, []

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine, "_encode", recording)

    async def work() -> int:
        await collect(engine.generate([{"role": "user", "content": text}], SamplingParams(max_tokens=1)))
        await collect(engine.generate_prompt(text, SamplingParams(max_tokens=1)))
        return threading.get_ident()

    loop_thread = asyncio.run(work())
    assert threads and loop_thread not in threads, "the route key was tokenized on the event loop"
    assert [len(c["route"].hashes) > 1000 for c in handle.calls] == [True, True]


# ---- stats() and /health --------------------------------------------------------------------------

class StatsHandle:
    """The LLM deployment's ``broadcast("replica_stats")``: one replica, alive, gone or hanging."""

    def __init__(self) -> None:
        self.alive, self.hang = True, False

    def broadcast(self, method: str) -> Broadcast:
        import ray.exceptions

        assert method == "replica_stats"
        if self.hang:
            return Broadcast([SILENT])
        if not self.alive:
            return Broadcast([ray.exceptions.RayActorError()])
        return Broadcast([("replica-0", SimpleNamespace(to_dict=lambda: {"requests_in_flight": 0}))])


@pytest.fixture
def fast_stats(monkeypatch):
    monkeypatch.setattr(remote_engine, "STATS_MAX_AGE_S", 0.05)
    monkeypatch.setattr(remote_engine, "STATS_STALE_S", 0.5, raising=False)  # absent before the fix
    monkeypatch.setattr(remote_engine, "STATS_TIMEOUT_S", 0.2, raising=False)


def test_health_is_503_once_no_replica_answers(fast_stats):
    """Every LLM replica gone: the failed refreshes were logged at DEBUG and /health served the last
    snapshot as 200 "ok" for ever."""
    from fastapi.testclient import TestClient

    from mm_pipeline.server.app import create_app
    from mm_pipeline.server.settings import ServerSettings

    handle = StatsHandle()
    engine = RemoteEngine(handle, None, "demo")
    asyncio.run(engine.refresh_stats())

    def poll_until(status: int) -> None:
        deadline = time.monotonic() + 5.0
        while (r := client.get("/health")).status_code != status:
            assert time.monotonic() < deadline, f"/health still {r.status_code}: {r.json()}"
            time.sleep(0.05)

    with TestClient(create_app(engine, ServerSettings(model_name="demo"))) as client:
        assert client.get("/health").status_code == 200
        handle.alive = False
        poll_until(503)
        assert "RayActorError" in client.get("/health").json()["error"]
        # the scrape still answers, without the engine's families (it was a 500 then)
        scrape = client.get("/metrics")
        assert scrape.status_code == 200 and "mmserve_engine_stats_available 0.0" in scrape.text
        handle.alive = True  # Serve started new replicas
        poll_until(200)
        assert "mmserve_engine_stats_available 1.0" in client.get("/metrics").text


def test_a_hung_stats_refresh_times_out(fast_stats):
    """A refresh waited for ever on a replica that never answered: no later refresh could start."""
    handle = StatsHandle()
    engine = RemoteEngine(handle, None, "demo")

    async def run() -> None:
        await engine.refresh_stats()
        handle.hang = True
        await asyncio.sleep(0.06)
        engine.stats()  # starts a refresh: it hangs
        await asyncio.sleep(0.4)
        assert engine._refreshing.done() and "TimeoutError" in (engine._stats_error or "")
        await asyncio.sleep(0.2)
        with pytest.raises(RuntimeError, match="no LLM replica has answered"):
            engine.stats()
        engine._refreshing.cancel()

    asyncio.run(run())


# ---- POST /tokenize on the ingress ------------------------------------------------------------------

class TokenizeHandle:
    """The LLM deployment's ``prompt_token_ids`` (answers ``answer``, or raises it) and its stats broadcast."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, []
        self.prompt_token_ids = SimpleNamespace(remote=self._tokenize)

    async def _tokenize(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def broadcast(self, method: str) -> Broadcast:
        snapshot = SimpleNamespace(llm=SimpleNamespace(max_context_tokens=1234), to_dict=lambda: {})
        return Broadcast([("replica-0", snapshot)])


def test_tokenize_asks_a_replica_and_raises_its_typed_errors():
    """The chat template and the media planner live on the LLM replicas: the ingress's /tokenize
    asks one, with the uploads the messages name, and answers its errors as one process would."""
    from fastapi.testclient import TestClient

    from mm_pipeline.errors import MediaNotFound
    from mm_pipeline.server.app import create_app
    from mm_pipeline.server.settings import ServerSettings

    class Tokenizer:
        def __len__(self) -> int:
            return 100

        def convert_ids_to_tokens(self, ids):
            return [f"t{i}" for i in ids]

    handle = TokenizeHandle([5, 6, 7])
    engine = RemoteEngine(handle, Tokenizer(), "demo")
    asyncio.run(engine.refresh_stats())
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(create_app(engine, ServerSettings(model_name="demo"))) as client:
        r = client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
        assert r.json() == {"count": 3, "max_model_len": 1234, "tokens": [5, 6, 7], "token_strs": ["t5", "t6", "t7"]}
        assert list(handle.calls[0]["messages"]) == messages and handle.calls[0]["prompt"] is None
        client.post("/tokenize", json={"prompt": "hi"})
        assert handle.calls[1]["prompt"] == "hi" and handle.calls[1]["add_special_tokens"] is True
        handle.answer = ReplicaFailure(MediaNotFound("no uploaded file with id 'file-x'"))
        assert client.post("/tokenize", json={"messages": messages}).status_code == 404
        handle.answer = ReplicaFailure(llm_replica.EngineStopped("the LLM replica's engine stopped", "replica-0"))
        assert client.post("/tokenize", json={"messages": messages}).status_code == 503
        import ray.exceptions

        handle.answer = ray.exceptions.RayActorError()
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 503


def test_each_handle_call_is_a_serve_request_of_its_own():
    """Serve's routers match a chosen replica to the waiting call by the request's internal id, which
    handle calls inherit from the HTTP request the ingress serves: each call gets its own (the n
    choices of one request were stuck sharing one), keeping the request id its logs carry, and the
    caller's context is left as it was. test_serve_app.py shows it on a cluster."""
    from ray.serve import context

    seen = []

    def call():
        ctx = context._get_serve_request_context()
        seen.append((ctx.request_id, ctx._internal_request_id))
        return len(seen)

    def in_request():
        context._set_request_context(request_id="client-id", _internal_request_id="http-request")
        assert [remote_engine.own_request(call) for _ in range(3)] == [1, 2, 3]
        return context._get_serve_request_context()._internal_request_id

    import contextvars

    assert contextvars.copy_context().run(in_request) == "http-request"
    assert [r for r, _ in seen] == ["client-id"] * 3
    assert len({i for _, i in seen} | {"http-request"}) == 4


def test_a_replica_failure_crosses_with_the_sentence_one_process_sends():
    """A library's text (a codec's) is left out of the client's message by the error's cause, which
    a pickle drops: the replica sends the message one process would, the type and fields kept."""
    import pickle

    from mm_pipeline.errors import OverloadedError, UndecodableMediaError
    from mm_pipeline.server.errors import public_message

    try:
        try:
            raise OSError("[Errno 1094995529] Invalid data found when processing input: '<none>'")
        except OSError as cause:
            raise UndecodableMediaError(f"messages[0].content[1]: video cannot be read ({cause})",
                                        loc=("messages", 0, "content", 1)) from cause
    except UndecodableMediaError as err:
        local = public_message(err)
        crossed = pickle.loads(pickle.dumps(ReplicaFailure.of(err))).error
    assert type(crossed) is UndecodableMediaError and str(crossed) == local == "messages[0].content[1]: video cannot be read"
    assert crossed.loc == ("messages", 0, "content", 1)  # the client's param
    busy = pickle.loads(pickle.dumps(ReplicaFailure.of(OverloadedError("full", retry_after=3.0)))).error
    assert str(busy) == "full" and busy.retry_after == 3.0
