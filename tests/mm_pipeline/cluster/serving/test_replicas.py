"""The replica classes without Ray (mm_pipeline/cluster/serving/llm_replica.py, encoder_replica.py): an encoder
replica's output reaches an LLM replica through the shared encoder cache (the LLM replica plans the
item and finds every unit), a typed media error travels as an item, uploaded bytes sent with a request
are served to the planner and released after, and the load the router reads returns to zero."""

from __future__ import annotations

import asyncio
import base64

import pytest

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.cluster.serving.encoder_replica import EncoderReplica
from mm_pipeline.cluster.serving.llm_replica import LLMReplica, ReplicaFailure, SharedFile
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
    enc.engine.shutdown()
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


def test_media_error_is_an_item_and_files_are_released(replicas):
    _, llm = replicas
    bad = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-x"}}]}]
    items = asyncio.run(collect(llm.generate("chat", bad, SamplingParams(max_tokens=2), "r2",
                                             files={"file-x": SharedFile(b"not media at all", "x.bin")})))
    assert len(items) == 1 and isinstance(items[0], ReplicaFailure) and isinstance(items[0].error, MediaError)
    assert llm._files == {}  # the upload's bytes are not kept past the request
    with pytest.raises(KeyError):
        llm._resolve("file-x")
