"""OpenAI-compatible HTTP server over an ``OmniEngine``: ``create_app(engine, ServerSettings(...))``."""

from mm_pipeline.server.app import create_app
from mm_pipeline.server.launch.runner import ServerThread, free_port
from mm_pipeline.server.settings import ServerSettings

__all__ = ["ServerSettings", "ServerThread", "create_app", "free_port"]
