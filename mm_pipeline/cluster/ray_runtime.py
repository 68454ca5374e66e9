"""Joining or starting the Ray cluster that ``--ray [ADDRESS]`` names: the one place mmserve calls
``ray.init``.

No address starts a local cluster on this machine (what a user trying ``--ray`` on a laptop expects);
an address (``auto``, ``ray://host:10001`` or ``host:6379``) joins a cluster started with ``ray start``.
Ray is an optional dependency, so a missing install is a clear error naming the extra, not an
ImportError from deep inside a job.

A local cluster is *not* loopback-only: its GCS, raylet, object manager and worker processes listen
on all interfaces, and Ray (2.60) has no setting to change that -- ``ray.init`` turns a node address
of 127.0.0.1 into this machine's routable one. What keeps other machines out is Ray's token
authentication, which Ray turns on for a new local cluster unless ``RAY_AUTH_MODE`` says otherwise
(the token lands in ``~/.ray/auth_token``), and a firewall on the host; ``RAY_AUTH_MODE=disabled``
leaves anyone who reaches the ports able to run code here, so connect() warns about it. The
dashboard is not started; Serve's HTTP proxy binds the ``--host`` it is given (127.0.0.1 by default)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

from mm_pipeline.errors import MMServeError

log = logging.getLogger(__name__)


class RayUnavailable(MMServeError):
    """``--ray`` was asked for but Ray is not installed."""


@dataclass(frozen=True)
class RayClusterConfig:
    address: str | None = None  # None: start a local cluster in this process
    num_cpus: int | None = None  # local cluster only; None lets Ray count the cores
    namespace: str = "mmserve"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RayUnavailable(
            "--ray needs Ray: pip install -e '.[ray]' (or pip install 'ray[data,serve]')"
        ) from exc
    return ray


def connect(config: RayClusterConfig) -> ModuleType:
    """Initialise Ray once per process and return the module; a second call is a no-op, so a job and
    the server can both call it."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    if config.address:
        ray.init(address=config.address, namespace=config.namespace, log_to_driver=True)
    else:
        # No dashboard (a job API that runs code). Not loopback-only: Ray's ports listen on every
        # interface whatever node address is given (module doc), so token auth is what guards them.
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            log.warning("RAY_AUTH_MODE=disabled: the local Ray cluster's ports listen on all interfaces "
                        "without authentication; anyone who can reach this machine can run code on it")
        ray.init(num_cpus=config.num_cpus, namespace=config.namespace, include_dashboard=False)
    return ray


def shutdown() -> None:
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()


def check_replica_gpus(device: str, world: int, gpus: float, flag: str, encoder_device: str | None = None) -> None:
    """ValueError when an engine on ``device`` (``world`` tensor/expert-parallel ranks; encoders on
    ``encoder_device``) cannot run in a Ray actor that reserved ``gpus`` GPUs (``flag``: the option
    that sets them, for the message). Ray shows an actor only the GPUs it reserved, renumbered
    cuda:0..N-1 (CUDA_VISIBLE_DEVICES), and an actor that reserved none every GPU of its node,
    uncounted -- so devices are checked against the reservation, not the machine running mmserve."""
    import torch

    llm = torch.device(device)
    enc = None if encoder_device is None else torch.device(encoder_device)
    cuda = [(what, d, n) for what, d, n in (("--device", llm, world), ("--encoder-device", enc, 1))
            if d is not None and d.type == "cuda"]
    if not cuda:
        if gpus > 0:
            raise ValueError(f"{flag} {gpus:g} reserves GPUs that replicas on {llm} would not use: give "
                             f"--device cuda, or {flag} 0")
        return
    if gpus <= 0:
        raise ValueError(f"{cuda[0][0]} {cuda[0][1]} needs {flag} > 0: a Ray actor with no GPUs reserved sees "
                         "every GPU of its node, uncounted, so every replica would take GPU 0")
    visible = max(1, int(gpus))  # a fraction of a GPU is still cuda:0 inside the actor
    if llm.type == "cuda" and world > visible:
        raise ValueError(f"{world} tensor/expert-parallel ranks per replica need {flag} {world} (one GPU each), "
                         f"got {gpus:g}")
    for what, d, count in cuda:
        if (d.index or 0) + count > visible:
            raise ValueError(f"{what} {d} is out of a replica's GPUs: Ray renumbers the {gpus:g} it reserved as "
                             f"cuda:0..{visible - 1} inside it")


def share_gpu_memory(config, gpus: float):
    """``config`` (an OmniEngineConfig) for replicas that reserved ``gpus`` GPUs: under one GPU, the
    KV pools' share of free memory (``memory_fraction``, used when no KV size is given) scaled by
    the reservation. Replicas sharing a GPU each measure its free memory -- at the same moment, the
    same figure -- so two at half a GPU and the default 0.5 would take all of it between them."""
    import dataclasses

    e = config.engine
    if not 0 < gpus < 1 or e.kv_cache_bytes is not None or e.num_full_tokens is not None:
        return config
    return dataclasses.replace(config, engine=dataclasses.replace(e, memory_fraction=e.memory_fraction * gpus))
