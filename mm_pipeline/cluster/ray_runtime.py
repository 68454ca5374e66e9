"""Joining or starting the Ray cluster that ``--ray [ADDRESS]`` names: the one place mmserve calls
``ray.init``.

No address starts a local cluster on this machine (what a user trying ``--ray`` on a laptop expects);
an address (``auto``, ``ray://host:10001`` or ``host:6379``) joins a cluster started with ``ray start``.
Ray is an optional dependency, so a missing install is a clear error naming the extra, not an
ImportError from deep inside a job."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from mm_pipeline.errors import MMServeError


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
        # A local cluster binds to loopback only and skips the dashboard: nothing listens beyond
        # this machine unless the user started a cluster with `ray start` themselves.
        ray.init(num_cpus=config.num_cpus, namespace=config.namespace, include_dashboard=False,
                 _node_ip_address="127.0.0.1")
    return ray


def shutdown() -> None:
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()
