"""The replica classes without Ray (mm_pipeline/cluster/serving/llm_replica.py, encoder_replica.py): an encoder
replica's output reaches an LLM replica through the shared encoder cache (the LLM replica plans the
item and finds every unit), a typed media error travels as an item, uploaded bytes sent with a request
are served to the planner and released after, and the load the router reads returns to zero. An
encoder replica loads no text model, and the rows it writes equal those an LLM replica (the whole
model) encodes itself. A replica whose engine (or encoder) stopped fails Serve's health check, tells
the router it is unusable and sends every request back to the ingress as ``EngineStopped``."""

from __future__ import annotations

import asyncio
import base64
import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from llm_core.distributed.rank_failure import RankFailure
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.cluster.serving import llm_replica as llm_replica_module
from mm_pipeline.cluster.serving.encoder_replica import EncoderReplica
from mm_pipeline.cluster.serving.llm_replica import LLMReplica, ReplicaFailure
from mm_pipeline.cluster.serving.route_key import key_of_pieces
from mm_pipeline.cluster.serving.shared_files import SharedFile
from mm_pipeline.errors import MediaError
from mm_pipeline.runtime.config import OmniEngineConfig
from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    config = OmniEngineConfig.from_kwargs(device="cpu", dtype="float32",
                                          cache_dir=str(tmp_path_factory.mktemp("shared-cache")))
    enc, llm = EncoderReplica(str(DEMO_MODEL), config), LLMReplica(str(DEMO_MODEL), config)
    yield enc, llm
    enc.shutdown()
    llm.engine.shutdown()


async def collect(gen):
    return [item async for item in gen]


def image_part() -> dict:
    data = base64.b64encode((SAMPLE_MEDIA / "image_000000.webp").read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/webp;base64,{data}"}}


def test_encoder_output_reaches_the_llm_replica(replicas):
    enc, llm = replicas
    first = asyncio.run(enc.encode(image_part()))
    assert first.units > 0 and first.hits == 0 and first.replica == "local"
    assert asyncio.run(enc.encode(image_part())).hits == first.units
    messages = [{"role": "user", "content": [image_part(), {"type": "text", "text": "What is it?"}]}]
    deltas = asyncio.run(collect(llm.generate("chat", messages, SamplingParams(max_tokens=4, temperature=0), "r1")))
    assert deltas[-1].finished and deltas[0].encoder_cache_hits == first.units  # nothing encoded again
    assert llm.record_routing_stats() == {"load_tokens": 0}


def test_an_encode_takes_the_requests_turns(replicas):
    """The request's flow and priority reach the replica's encoder jobs (media/flows.py)."""
    enc, _ = replicas
    batcher = enc.runtime.batcher
    jobs = []

    def spy(job):
        jobs.append(job)
        return submit(job)

    submit, batcher.submit = batcher.submit, spy
    try:
        asyncio.run(enc.encode(image_part(), flow="req-9", priority=3, salt="turns"))
    finally:
        del batcher.submit  # the class's method again
    assert jobs and {(j.flow, j.priority) for j in jobs} == {("req-9", 3)}


def test_media_error_is_an_item_and_files_are_released(replicas):
    _, llm = replicas
    bad = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-x"}}]}]
    items = asyncio.run(collect(llm.generate("chat", bad, SamplingParams(max_tokens=2), "r2",
                                             files={"file-x": SharedFile(b"not media at all", "x.bin")})))
    assert len(items) == 1 and isinstance(items[0], ReplicaFailure) and isinstance(items[0].error, MediaError)
    assert len(llm.files) == 0  # the upload's bytes are not kept past the request
    with pytest.raises(KeyError):
        llm.files.resolve("file-x")


def test_load_counts_only_the_prompt_not_sent_here_before(replicas):
    """A queued prompt whose prefix the replica was sent already is mostly cached: the reported load
    is its new tokens (+ decode), the same measure as the router's (prompt - matched)."""
    _, llm = replicas
    system = ("tokens", list(range(200, 264)))  # 4 blocks
    first = key_of_pieces([system, ("tokens", list(range(300, 316)))])
    second = key_of_pieces([system, ("tokens", list(range(400, 432)))])

    async def load_while_queued(key, rid):
        task = asyncio.ensure_future(collect(llm.generate("prompt", [5, 6, 7], SamplingParams(max_tokens=2),
                                                          rid, route=key)))
        await asyncio.sleep(0)  # the call has started; its first delta needs the loop again
        load = llm.record_routing_stats()["load_tokens"]
        await task
        return load

    assert asyncio.run(load_while_queued(first, "q1")) == 80 + 2
    assert asyncio.run(load_while_queued(second, "q2")) == 32 + 2  # the 64 system tokens were sent here
    assert llm.record_routing_stats() == {"load_tokens": 0}


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def cache_files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_encoder_replica_loads_no_text_model_and_writes_the_same_rows(replicas, tmp_path):
    enc, llm = replicas
    assert enc.runtime.model.text is None and enc.runtime.llm is None  # no text weights, no KV pools
    whole = llm.engine.runtime.model
    towers = n_params(whole.vision) + n_params(whole.audio)
    assert n_params(enc.runtime.model.vision) + n_params(enc.runtime.model.audio) == towers
    assert towers < n_params(whole.text)  # what the encoder replica no longer holds
    # the same image encoded by a fresh encoder replica and by an LLM replica on its own (separate
    # caches): the same cache entries, byte for byte
    dirs = {name: tmp_path / name for name in ("enc", "llm")}
    alone_enc = EncoderReplica(str(DEMO_MODEL), OmniEngineConfig.from_kwargs(device="cpu", dtype="float32",
                                                                             cache_dir=str(dirs["enc"])))
    alone_llm = LLMReplica(str(DEMO_MODEL), OmniEngineConfig.from_kwargs(device="cpu", dtype="float32",
                                                                         cache_dir=str(dirs["llm"])))
    try:
        assert asyncio.run(alone_enc.encode(image_part())).hits == 0
        messages = [{"role": "user", "content": [image_part(), {"type": "text", "text": "What is it?"}]}]
        deltas = asyncio.run(collect(alone_llm.generate("chat", messages, SamplingParams(max_tokens=2), "r3")))
        assert deltas[0].encoder_cache_hits == 0  # it encoded the image itself
        alone_llm.engine.runtime.cache.flush()
        written = cache_files(dirs["enc"])
        assert written and written == cache_files(dirs["llm"])
    finally:
        alone_enc.shutdown()
        alone_llm.engine.shutdown()


def test_a_replica_whose_engine_stopped_is_unhealthy_and_sends_requests_back(monkeypatch):
    """A tensor-parallel rank died: the engine loop stopped for good but the replica (an actor) lived
    on. It had no check_health, so Serve kept it; it reported load 0, so the affinity router
    preferred it; and each request failed with a plain RuntimeError (HTTP 500, never resent)."""
    replica = LLMReplica(str(DEMO_MODEL), OmniEngineConfig.from_kwargs(device="cpu", dtype="float32"))
    try:
        replica.check_health()  # a running engine is healthy
        name, snapshot = replica.replica_stats()  # what the ingress's stats broadcast gathers
        assert name == "local" and snapshot.llm.max_context_tokens > 0
        params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

        async def die_mid_request() -> tuple[object, list]:
            gen = replica.generate("prompt", [5, 6, 7, 8], params, "long")
            first = await gen.__anext__()

            def rank_gone() -> None:
                raise RankFailure("tensor/expert-parallel rank 1 (pid 4242) exited with code -9")
            # the engine loop checks its ranks every iteration: the next one ends the engine
            monkeypatch.setattr(replica.engine.runtime.llm, "check_health", rank_gone)
            return first, [item async for item in gen]

        first, rest = asyncio.run(die_mid_request())
        assert not first.finished and replica.engine.runtime.loop.fatal is not None
        stopped_type = llm_replica_module.EngineStopped
        assert isinstance(rest[-1], ReplicaFailure) and isinstance(rest[-1].error, stopped_type), rest[-1:]
        assert not any(getattr(d, "error", None) for d in rest[:-1])  # no error delta reaches the ingress
        with pytest.raises(stopped_type):
            replica.check_health()  # Serve replaces the replica
        routing = replica.record_routing_stats()
        assert routing["engine_stopped"] and math.isinf(routing["load_tokens"])
        with pytest.raises(stopped_type):
            replica.stats()  # the ingress's /health must not read its last snapshot as "ok"
        with pytest.raises(stopped_type):
            replica.replica_stats()  # left out of the ingress's snapshots
        later = asyncio.run(collect(replica.generate("prompt", [5, 6, 7], SamplingParams(max_tokens=2), "later")))
        assert len(later) == 1 and isinstance(later[0].error, stopped_type)
        sent = pickle.loads(pickle.dumps(later[0]))  # what reaches the ingress: still naming the replica
        assert isinstance(sent.error, stopped_type) and sent.error.replica == "local"
        assert replica.record_routing_stats()["load_tokens"] == math.inf and not replica._load
    finally:
        replica.engine.shutdown()


def test_an_encoder_replica_without_its_encoder_is_unhealthy(replicas, monkeypatch):
    """Its encoder threads gone, an encoder replica took every item its content keys hash to and
    answered none: the ingress waited encoder_timeout_s (120 s) for each."""
    enc, _ = replicas
    enc.check_health()
    monkeypatch.setattr(enc.runtime, "encoder_worker", SimpleNamespace(alive=False))
    with pytest.raises(RuntimeError, match="encoder threads"):
        enc.check_health()
    with pytest.raises(RuntimeError, match="encoder threads"):
        asyncio.run(asyncio.wait_for(enc.encode(image_part()), 5.0))  # at once, not after a timeout
    monkeypatch.undo()
    monkeypatch.setattr(enc.runtime.loop, "fatal", RankFailure("gone"))
    with pytest.raises(RuntimeError, match="engine loop stopped"):
        enc.check_health()


def test_prompt_token_ids_are_the_engines_and_files_are_released(replicas):
    """POST /tokenize on the ingress asks a replica: the ids its engine would run, uploads served while
    it plans them, typed errors as items."""
    _, llm = replicas
    png = (SAMPLE_MEDIA / "image_000001.png").read_bytes()
    messages = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-i"}},
                                             {"type": "text", "text": "What is it?"}]}]
    ids = asyncio.run(llm.prompt_token_ids(messages=messages, files={"file-i": SharedFile(png, "i.png")}))
    inline = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": "What is it?"}]}]
    assert isinstance(ids, list) and ids == asyncio.run(llm.engine.prompt_token_ids(messages=inline))
    assert len(llm.files) == 0
    failed = asyncio.run(llm.prompt_token_ids(messages=messages))  # the file was not sent this time
    assert isinstance(failed, ReplicaFailure) and isinstance(failed.error, MediaError)
