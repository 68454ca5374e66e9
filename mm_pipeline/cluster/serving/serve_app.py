"""``mmserve serve --ray``: the OpenAI-compatible app on Ray Serve, LLM engines in replicas.

    clients ──HTTP──► Serve proxy ──► Ingress replica(s)            LLM replicas (LLMReplica)
                                      @serve.ingress: create_app()  ┌─► engine 0: KV, prefix cache,
                                      over RemoteEngine ──handle────┤   encoders, media workers
                                      (route key: tokens + media    └─► engine 1 ...
                                       content keys)  ▲                  │ record_routing_stats:
                                                      └── PrefixAffinityRouter ◄── tokens still to compute
                                                          radix tree of dispatched prefixes (Redis)

The ingress is our FastAPI app itself (mm_pipeline/server/app.py, built per replica by
``__serve_build_asgi_app__``), so every endpoint, SSE stream, upload and error status is the one a
single process serves. Each LLM replica owns a whole OmniEngine; with ``redis_url`` they share the
encoder cache, and with ``kv_store: redis://...`` the KV L3 tier, so a prefix evicted on one replica
(or computed on another) is loaded instead of recomputed. The LLM deployment's request router is
:class:`PrefixAffinityRouter` (``router="affinity"``) or Ray Serve's default power-of-two-choices
(``router="pow2"``) or replicas in turn (``router="round_robin"``): the baselines
``benchmarks/router.py`` measures against.

With ``encoder_replicas`` the ingress first sends each media item of a chat to an encoder replica
(mm_pipeline/cluster/serving/encoder_replica.py), chosen by consistent hashing of its content key with
bounded loads (encoder_router.py); the embeddings reach the LLM replica through the shared encoder
cache, and anything the tier did not deliver the LLM replica encodes itself.

Every node that runs a replica needs mmserve importable (installed, or on ``PYTHONPATH``) and the
model directory at the same path; a local cluster (``--ray`` without an address) gets both from
this process's environment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llm_core.engine.sampling.generation_config import GenerationDefaults
from mm_pipeline.cluster.serving.encoder_replica import EncoderReplica
from mm_pipeline.cluster.serving.llm_replica import LLMReplica
from mm_pipeline.cluster.serving.remote_engine import RemoteEngine
from mm_pipeline.cluster.serving.request_id_headers import IngressRequestId, proxy_env
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.server.launch.listen import Listen
from mm_pipeline.server.settings import ServerSettings

log = logging.getLogger(__name__)

ROUTERS = ("affinity", "pow2", "round_robin")
LLM_DEPLOYMENT = "LLM"
ENCODER_DEPLOYMENT = "Encoder"
INGRESS_DEPLOYMENT = "Ingress"


@dataclass(frozen=True)
class ServeClusterConfig:
    """How the app is laid out on the cluster (the engine itself is the ``OmniEngineConfig``)."""

    llm_replicas: int = 2
    encoder_replicas: int = 0  # 0: each LLM replica encodes its own media
    ingress_replicas: int = 1
    llm_num_cpus: float = 1.0  # Ray resources per LLM replica (fractions share a node's cores)
    llm_num_gpus: float = 0.0
    ingress_num_cpus: float = 0.25
    encoder_num_cpus: float = 1.0
    # GPUs per encoder replica; None: one when the LLM replicas use GPUs (their share when under one),
    # else none. An encoder replica holds only the towers on one device (encoder_device), so it must
    # not reserve what a tensor-parallel LLM replica does (8 for TP-8: most of a node, idle)
    encoder_num_gpus: float | None = None
    encoder_timeout_s: float = 120.0  # an encoder call slower than this is left to the LLM replica
    torch_threads: int | None = None  # intra-op threads per LLM replica; None: torch's default
    router: str = "affinity"
    router_redis_url: str | None = None  # the router's prefix tree; None: each ingress keeps its own
    match_weight: float = 1.5
    routing_stats_period_s: float = 0.5
    max_ongoing_requests: int = 64  # per LLM replica, what Serve admits before queueing at the router
    retries: int = 2  # resends of a request whose replica died before its first token
    listen: Listen = Listen()  # host, port, TLS and root path of Serve's HTTP proxy
    app_name: str = "mmserve"

    def __post_init__(self) -> None:
        if self.llm_replicas < 1 or self.ingress_replicas < 1:
            raise ValueError(f"need at least one LLM and one ingress replica, got {self.llm_replicas}, "
                             f"{self.ingress_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.encoder_replicas < 0:
            raise ValueError(f"encoder_replicas must be >= 0, got {self.encoder_replicas}")
        if self.llm_num_cpus <= 0 or self.ingress_num_cpus <= 0 or self.encoder_num_cpus <= 0:
            raise ValueError("replica CPU shares must be positive")
        if self.llm_num_gpus < 0 or (self.encoder_num_gpus is not None and self.encoder_num_gpus < 0):
            raise ValueError("replica GPU counts must be >= 0")
        if self.encoder_num_gpus == 0 and self.llm_num_gpus > 0:
            # the engine config (device) is the LLM replicas': an encoder replica would look for a GPU
            raise ValueError("encoder replicas run on the LLM replicas' device: with llm_num_gpus > 0 they "
                             "need encoder_num_gpus > 0")

    @property
    def encoder_gpus(self) -> float:
        """GPUs each encoder replica reserves (``encoder_num_gpus`` resolved)."""
        if self.encoder_num_gpus is not None:
            return self.encoder_num_gpus
        return min(1.0, self.llm_num_gpus)


def build_app(model_dir: str | Path, engine_config: OmniEngineConfig, settings: ServerSettings,
              cluster: ServeClusterConfig) -> Any:
    """The bound Serve application (``serve.run`` it). Imports Ray: only for ``--ray``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llm_core.llm import load_tokenizer

    if cluster.encoder_replicas and not (engine_config.cache_dir or engine_config.redis_url):
        raise ValueError("encoder replicas hand embeddings to the LLM replicas through the encoder cache: give "
                         "--redis-url, or --encoder-cache-dir on a file system every replica sees")
    model_dir = str(Path(model_dir).resolve())
    e = engine_config.engine
    # the ingress builds the requests' sampling: it applies the checkpoint's generation config (read
    # here, so a bad one fails the start, not each ingress replica)
    defaults = GenerationDefaults.load(model_dir, e.generation_config, e.override_generation_config)
    # the ingress holds every LLM replica's snapshot (replica_metrics.py), not one engine's: the
    # periodic engine line is a single-engine server's (each replica's numbers: the ingress's /metrics)
    settings = replace(settings, model_name=settings.model_name or Path(model_dir).name, log_stats_interval_s=0.0)

    router_kwargs: dict[str, Any] = {}
    if cluster.router == "affinity":
        router_kwargs = dict(request_router_class="mm_pipeline.cluster.serving.prefix_router.PrefixAffinityRouter",
                             request_router_kwargs={"redis_url": cluster.router_redis_url,
                                                    "match_weight": cluster.match_weight})
    elif cluster.router == "round_robin":
        router_kwargs = dict(request_router_class="mm_pipeline.cluster.serving.prefix_router.RoundRobinRouter")
    llm = serve.deployment(LLMReplica, name=LLM_DEPLOYMENT).options(
        num_replicas=cluster.llm_replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={"num_cpus": cluster.llm_num_cpus, "num_gpus": cluster.llm_num_gpus},
        request_router_config=RequestRouterConfig(request_routing_stats_period_s=cluster.routing_stats_period_s,
                                                  request_routing_stats_timeout_s=5.0, **router_kwargs),
        health_check_period_s=2.0,
    )

    encoders = None
    if cluster.encoder_replicas:
        encoders = serve.deployment(EncoderReplica, name=ENCODER_DEPLOYMENT).options(
            num_replicas=cluster.encoder_replicas, max_ongoing_requests=cluster.max_ongoing_requests,
            ray_actor_options={"num_cpus": cluster.encoder_num_cpus, "num_gpus": cluster.encoder_gpus},
            request_router_config=RequestRouterConfig(
                request_router_class="mm_pipeline.cluster.serving.encoder_router.ContentHashRouter"),
            health_check_period_s=2.0,
        ).bind(model_dir, engine_config, cluster.torch_threads)

    @serve.ingress()
    class Ingress:
        """Our FastAPI app over a RemoteEngine to the LLM deployment (and the encoder tier)."""

        async def __init__(self, llm_handle: Any, encoder_handle: Any = None) -> None:
            if settings.log_requests:
                log_requests_here()
            self.engine = RemoteEngine(llm_handle, load_tokenizer(model_dir), settings.model_name,
                                       retries=cluster.retries, encoders=encoder_handle,
                                       encoder_timeout_s=cluster.encoder_timeout_s, generation_defaults=defaults,
                                       limits=engine_config.limits, config=engine_config)
            await self.engine.wait_for_replicas()  # fails the replica's start if no LLM replica answers

        def __serve_build_asgi_app__(self) -> Any:
            return ingress_app(self.engine, settings)

    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=cluster.ingress_replicas, max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": cluster.ingress_num_cpus})
    return ingress.bind(llm.bind(model_dir, engine_config, cluster.torch_threads), encoders)


def log_requests_here() -> None:
    """``--enable-log-requests`` in this (ingress replica's) process: ``serve`` raises the
    ``mmserve.requests`` logger to INFO in the driver, which serves no request under ``--ray``; here
    the root logger has no handler of mmserve's (Python's last resort shows warnings only), so the
    logger gets its own, on the replica's stderr -- its log file, which Ray streams to the driver."""
    logger = logging.getLogger("mmserve.requests")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))  # main()'s
        logger.addHandler(handler)
        logger.propagate = False  # a root handler Ray may have set would print each line twice


def ingress_app(engine: Any, settings: ServerSettings) -> Any:
    """The ingress's ASGI app: ours with the replicas' engine metrics (replica_metrics.py), reading the
    client's request id as Serve's proxy passed it on (request_id_headers.py), not the id the proxy
    made up."""
    from mm_pipeline.cluster.serving.replica_metrics import create_ingress_app

    app = create_ingress_app(engine, settings)
    app.add_middleware(IngressRequestId)  # the outermost, outside RequestIdHeader
    return app


def start(model_dir: str | Path, engine_config: OmniEngineConfig, settings: ServerSettings,
          cluster: ServeClusterConfig, *, blocking: bool = False) -> Any:
    """Start Serve's HTTP proxy on ``cluster.listen`` (host, port, TLS) and run the app (Ray must be connected:
    mm_pipeline/cluster/ray_runtime.py). Returns the ingress handle."""
    from ray import serve

    wanted = cluster.listen.ray_http_options()
    # the proxies inherit the controller's environment: ours wraps their request-id middleware
    serve.start(http_options=wanted, controller_options={"runtime_env": {"env_vars": proxy_env()}})
    check_http_options(wanted)
    return serve.run(build_app(model_dir, engine_config, settings, cluster), name=cluster.app_name,
                     route_prefix="/", blocking=blocking)


def check_http_options(wanted: dict[str, Any]) -> None:
    """Serve already running (an earlier ``serve --ray`` on the cluster, KubeRay) keeps its proxy and
    only logs that new HTTP options are ignored: a server asked for TLS would then answer plain HTTP
    while we print an https:// URL. Refuse instead, naming what differs."""
    from ray.serve.context import _get_global_client  # the running controller's view (no public getter)

    running = _get_global_client().http_config
    differ = sorted(k for k, v in wanted.items() if getattr(running, k, None) != v)
    if differ:
        raise ValueError(f"Ray Serve is already running with other HTTP options ({', '.join(differ)}); "
                           f"stop it first (`serve shutdown`) or serve with its settings")


def stop(cluster: ServeClusterConfig) -> None:
    from ray import serve

    serve.delete(cluster.app_name)
