"""OpenAI-compatible HTTP server over an ``OmniEngine``: ``create_app(engine, ServerSettings(...))``.

The names below load on first use (PEP 562): importing one of this package's light modules
(``request_id``, which Ray Serve's proxies import at their start) must not import the app,
and with it torch and the engine."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mm_pipeline.server.app import create_app
    from mm_pipeline.server.launch.runner import ServerThread, free_port
    from mm_pipeline.server.settings import ServerSettings

_WHERE = {"create_app": "mm_pipeline.server.app", "ServerThread": "mm_pipeline.server.launch.runner",
          "free_port": "mm_pipeline.server.launch.runner", "ServerSettings": "mm_pipeline.server.settings"}
__all__ = ["ServerSettings", "ServerThread", "create_app", "free_port"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
