"""One LLM replica of the Ray Serve app: its own :class:`OmniEngine` (engine thread, KV pools, prefix
cache, encoders and media workers), called by the ingress through a ``DeploymentHandle``.

A plain class (mm_pipeline/cluster/serving/serve_app.py makes it a deployment), so nothing here needs Ray.
What crosses the process boundary is picklable and small: the parsed request in, a stream of
:class:`GenerationDelta` out. A typed pipeline error (bad media, too long, overloaded) raised before
the first delta travels as a :class:`ReplicaFailure` item rather than as a Ray task error, so the
ingress re-raises the *same* type and the client gets the same 4xx as from one process.

A replica whose engine stopped for good (a tensor/expert-parallel rank died: the engine loop's
``fatal``) is alive as an actor but can serve nothing, so it says so everywhere Ray Serve and the
ingress look: ``check_health`` raises (Serve replaces the replica), ``record_routing_stats`` reports
it unusable (the routers skip it until then), and every request it gets ends with
:class:`EngineStopped` as a ``ReplicaFailure`` item, which the ingress treats like a dead replica:
it resends the request elsewhere (before the first token) or ends it with a 503.

Uploaded files live on the ingress; it sends the bytes of the files a request names with the request
(``files``), and the replica serves them to its planner while the request runs (shared_files.py).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.cluster.serving.router_state import MemoryPrefixIndex
from mm_pipeline.cluster.serving.shared_files import ReplicaFiles, SharedFile
from mm_pipeline.errors import MMServeError, ServerBusy
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.runtime.omni_engine import OmniEngine
from mm_pipeline.runtime.stats import OmniStats
from mm_pipeline.server.errors import public_message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaFailure:
    """A typed error the replica raised before the first delta (re-raised by the ingress), or
    :class:`EngineStopped` at any point of the stream. Built by :meth:`of`."""

    error: MMServeError

    @classmethod
    def of(cls, error: MMServeError) -> "ReplicaFailure":
        """``error`` as it crosses to the ingress: its message already the sentence a client of one
        process reads (``public_message``). That sentence leaves out a library's text (a codec's, PIL's)
        by the error's ``__cause__``, which a pickle drops: the ingress would have sent it to the
        client. The whole text stays in this replica's log."""
        public = public_message(error)
        if public != str(error):
            log.info("request failed: %s: %s", type(error).__name__, error)
            error.args = (public,)
        return cls(error)


class EngineStopped(ServerBusy):
    """The replica's engine stopped for good; ``replica`` names the replica (Serve's unique id) so the
    ingress can ask the router to send the request elsewhere. A 503 if it ever reaches a client."""

    def __init__(self, message: str, replica: str = "") -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.replica)  # crosses to the ingress pickled: keep ``replica``


def replica_name() -> str:
    """This replica's Serve id (what the routers see as ``replica_id.unique_id``); "local" outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit use): no replica name
        return "local"


class LLMReplica:
    def __init__(self, model_dir: str, config: OmniEngineConfig, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            import torch

            # several replicas share a node's cores: each gets its share, not all of them
            torch.set_num_threads(torch_threads)
        self.engine = OmniEngine.from_pretrained(Path(model_dir), config)
        self.files = ReplicaFiles()
        self.engine.set_file_resolver(self.files.resolve)
        self._load: dict[int, int] = {}  # call -> tokens still to compute (queued + running work)
        # the route keys' blocks this replica was sent, at most its Full KV pool's pages (LRU): a
        # queued prompt's leading blocks found here are (most likely) in its prefix cache, not work
        pool = self.engine.stats().llm.kv_pool["full"]
        self._seen = MemoryPrefixIndex(max_blocks_per_replica=max(1, pool.total_pages))
        self._calls = itertools.count()

    async def generate(self, kind: str, payload: Any, params: SamplingParams, request_id: str,
                       files: dict[str, SharedFile] | None = None, route: Any = None,
                       avoid: tuple[str, ...] = (), priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[Any]:
        """``kind`` "chat" (payload: messages) or "prompt" (text or token ids). ``route`` is the
        router's key (mm_pipeline/cluster/serving/prefix_router.py); until the first delta the load is
        its tokens not already sent here (the prefix cache holds the rest), the same measure as the
        router's own count (prompt - matched). ``avoid``: replicas the router must skip (read by the
        router only). ``priority``, ``cache_salt``: this replica's engine's (``OmniEngine.generate``)."""
        stopped = self._stopped()
        if stopped is not None:  # Serve has not replaced this replica yet: send the request back
            yield ReplicaFailure.of(stopped)
            return
        call = next(self._calls)
        uncached = 0
        if route is not None:
            uncached = route.total - route.weight_of(self._seen.match(route.hashes, ["self"])["self"])
            self._seen.record("self", route.hashes)
        self._load[call] = uncached + params.max_tokens
        self.files.hold(files)
        try:
            opts = dict(request_id=request_id, priority=priority, cache_salt=cache_salt)
            gen = (self.engine.generate(payload, params, **opts) if kind == "chat"
                   else self.engine.generate_prompt(payload, params, **opts))
            try:
                async for delta in gen:
                    stopped = self._stopped() if delta.finish_reason == "error" else None
                    if stopped is not None:  # ended by the engine's death, not by this request
                        yield ReplicaFailure.of(stopped)
                        return
                    # tokens still to compute: the prompt is computed once the first delta exists,
                    # what is left is decode (a cached prefix must not count as work)
                    self._load[call] = max(0, params.max_tokens - delta.completion_tokens)
                    yield delta
            except MMServeError as exc:
                yield ReplicaFailure.of(exc)
            except RuntimeError:  # the engine refuses new requests once it stopped
                stopped = self._stopped()
                if stopped is None:
                    raise
                yield ReplicaFailure.of(stopped)
            finally:
                await gen.aclose()
        finally:
            self._load.pop(call, None)
            self.files.release(files)

    async def prompt_token_ids(self, messages: Any = None, prompt: str | None = None, add_special_tokens: bool = False,
                               files: dict[str, SharedFile] | None = None) -> list[int] | ReplicaFailure:
        """``OmniEngine.prompt_token_ids`` (``POST /tokenize`` on the ingress): the chat template and
        media planning live here. A typed error comes back as a :class:`ReplicaFailure`, as in
        ``generate``; ``files``: the uploads the messages name, served while it runs."""
        stopped = self._stopped()
        if stopped is not None:
            return ReplicaFailure.of(stopped)
        self.files.hold(files)
        try:
            return await self.engine.prompt_token_ids(messages=messages, prompt=prompt,
                                                      add_special_tokens=add_special_tokens)
        except MMServeError as exc:
            return ReplicaFailure.of(exc)
        finally:
            self.files.release(files)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this for the request router (``RunningReplica.routing_stats``). A stopped
        engine has no load left, and 0 would make it every router's favourite: infinite instead."""
        if self._stopped() is not None:
            return {"load_tokens": math.inf, "engine_stopped": True}
        return {"load_tokens": sum(self._load.values())}

    def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s`` (only because it is defined); raising
        marks the replica unhealthy and Serve replaces it. Without it a replica whose engine died
        stays in rotation for good: the actor itself is alive."""
        stopped = self._stopped()
        if stopped is not None:
            raise stopped

    def stats(self) -> OmniStats:
        """Raises once the engine stopped: its last snapshot would tell the ingress's /health that
        all is well."""
        stopped = self._stopped()
        if stopped is not None:
            raise stopped
        return self.engine.stats()

    def replica_stats(self) -> tuple[str, OmniStats]:
        """``stats()`` with this replica's Serve id: what the ingress's broadcast gathers from every
        replica (replica_metrics.py labels each one's metrics with it)."""
        return replica_name(), self.stats()

    def describe(self) -> dict[str, Any]:
        return {"model_name": self.engine.model_name}

    def _stopped(self) -> EngineStopped | None:
        fatal = self.engine.runtime.loop.fatal
        if fatal is None:
            return None
        return EngineStopped(f"the LLM replica's engine stopped: {fatal}", replica_name())

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
