"""One encoder replica (the encoder tier of ``serve --ray --encoder-replicas M``): decodes, preprocesses
and encodes the media items the ingress sends it, into the encoder cache the LLM replicas share.

The hand-over is the shared encoder cache (a ``cache_dir`` every replica sees, or ``redis_url``): the
replica plans the item exactly as an LLM replica would (same content keys, same units), encodes the
units it does not find, and flushes the cache's write-behind queue before it answers, so the LLM
replica that plans the same item next finds every unit there and encodes nothing. If the tier is
slow, down or wrong, the LLM replica simply misses and encodes locally: correctness never depends on
the tier, only speed does.

It loads the omni runtime encoders-only (``OmniRuntime.load(..., encoders_only=True)``): the towers,
preprocessing, media planner, decode workers, encoder batcher and cache, and no text model, no KV
pools -- the same parts an LLM replica encodes with, so the rows are the same.

A replica whose encoder threads are gone would take every item its content keys hash to and answer
none (the ingress waits ``encoder_timeout_s`` for each): ``check_health`` raises then, so Ray Serve
replaces it, and ``encode`` fails at once instead of waiting for an encoder that never runs.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path

from mm_pipeline.cluster.serving.llm_replica import replica_name
from mm_pipeline.cluster.serving.shared_files import ReplicaFiles, SharedFile
from mm_pipeline.media.flows import flow as pool_flow
from mm_pipeline.prompt.messages import parse_messages
from mm_pipeline.runtime.components import OmniRuntime
from mm_pipeline.runtime.config import OmniEngineConfig


@dataclass(frozen=True)
class EncodeReport:
    units: int  # encoder units of the item
    hits: int  # of them already in the cache when it was planned
    replica: str  # which encoder replica did it (tests and logs)


class EncoderReplica:
    def __init__(self, model_dir: str, config: OmniEngineConfig, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)  # several replicas share a node's cores
        self.runtime = OmniRuntime.load(Path(model_dir), config, encoders_only=True)
        self.files = ReplicaFiles()
        self.runtime.planner.file_resolver = self.files.resolve
        self.runtime.start()

    async def encode(self, part: dict, files: dict[str, SharedFile] | None = None,
                     media_key: str | None = None, salt: str | None = None, flow: str | None = None,
                     priority: int = 0) -> EncodeReport:
        """Encode one media content part into the shared cache. ``media_key`` is the router's
        (mm_pipeline/cluster/serving/encoder_router.py); the replica does not need it. ``salt``:
        the request's cache_salt -- its units are written under its salted keys, where the LLM
        replica looks for them and no other tenant can hit them. ``flow``, ``priority``: the
        request's (media/flows.py): its items take its turns in the media workers and the encoder
        queue, at its priority (None: this encode is a flow of its own)."""
        self.check_health()
        rt = self.runtime
        self.files.hold(files)
        rid = f"enc-{uuid.uuid4().hex[:12]}"
        try:
            with pool_flow(flow or rid, priority):  # the request's turns (media workers, encoder queue)
                prepared = await rt.prepare_chat(parse_messages([{"role": "user", "content": [part]}]), salt=salt)
                units = sum(len(p.units) for p in prepared.plans)
                hits = sum(len(p.cached) for p in prepared.plans)
                loop = asyncio.get_running_loop()
                progressed = asyncio.Event()
                feed = rt.open_media(prepared, rid, on_progress=lambda: loop.call_soon_threadsafe(progressed.set))
                feed.start()
            try:
                while not feed.stream.complete and feed.stream.error is None:
                    await progressed.wait()
                    progressed.clear()
                if feed.stream.error is not None:
                    raise feed.stream.error
            finally:
                feed.close()
            await asyncio.to_thread(rt.cache.flush)  # on disk / in Redis before the LLM replica looks
        finally:
            self.files.release(files)
        return EncodeReport(units, hits, replica_name())

    def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s``; raising has the replica replaced."""
        rt = self.runtime
        if rt.loop.fatal is not None:
            raise RuntimeError(f"the encoder replica's engine loop stopped: {rt.loop.fatal}")
        if rt.encoder_worker is not None and not rt.encoder_worker.alive:
            raise RuntimeError("the encoder replica's encoder threads are gone")

    def shutdown(self) -> None:
        self.runtime.shutdown()

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.shutdown()
