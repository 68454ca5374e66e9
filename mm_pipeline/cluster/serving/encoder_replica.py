"""One encoder replica (the encoder tier of ``serve --ray --encoder-replicas M``): decodes, preprocesses
and encodes the media items the ingress sends it, into the encoder cache the LLM replicas share.

The hand-over is the shared encoder cache (a ``cache_dir`` every replica sees, or ``redis_url``): the
replica plans the item exactly as an LLM replica would (same content keys, same units), encodes the
units it does not find, and flushes the cache's write-behind queue before it answers, so the LLM
replica that plans the same item next finds every unit there and encodes nothing. If the tier is
slow, down or wrong, the LLM replica simply misses and encodes locally: correctness never depends on
the tier, only speed does.

It reuses the LLM replica's engine (media planner, decode workers, encoder batcher and cache are
parts of the omni runtime, driven by its engine thread) and file hand-over; its LLM weights stay idle.
Splitting the runtime so an encoder replica loads only the encoders is left for later: for the demo
model it costs a few MB, for a real checkpoint it is the LLM's memory.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from mm_pipeline.cluster.serving.llm_replica import LLMReplica, SharedFile
from mm_pipeline.prompt.messages import parse_messages


@dataclass(frozen=True)
class EncodeReport:
    units: int  # encoder units of the item
    hits: int  # of them already in the cache when it was planned
    replica: str  # which encoder replica did it (tests and logs)


class EncoderReplica(LLMReplica):
    async def encode(self, part: dict, files: dict[str, SharedFile] | None = None,
                     media_key: str | None = None) -> EncodeReport:
        """Encode one media content part into the shared cache. ``media_key`` is the router's
        (mm_pipeline/cluster/serving/encoder_router.py); the replica does not need it."""
        rt = self.engine.runtime
        self._hold(files)
        try:
            prepared = await rt.prepare_chat(parse_messages([{"role": "user", "content": [part]}]))
            units = sum(len(p.units) for p in prepared.plans)
            hits = sum(len(p.cached) for p in prepared.plans)
            loop = asyncio.get_running_loop()
            progressed = asyncio.Event()
            feed = rt.open_media(prepared, f"enc-{uuid.uuid4().hex[:12]}",
                                 on_progress=lambda: loop.call_soon_threadsafe(progressed.set))
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
            self._release(files)
        return EncodeReport(units, hits, self._name())

    @staticmethod
    def _name() -> str:
        try:
            from ray import serve

            return serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit use): no replica name
            return "local"
