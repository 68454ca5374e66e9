"""Text core: hybrid SWA MoE model, dual KV pool, scheduler, sampling, engine and offline API.

    from llm_core import LLM, SamplingParams
"""

from llm_core.kvcache.dual_pool import DualKVPool, KVLayout, PageAllocator
from llm_core.engine.engine_config import EngineConfig
from llm_core.engine.llm_engine import LLMEngine
from llm_core.llm import LLM
from llm_core.engine.outputs import ErrorKind, RequestOutput
from llm_core.engine.request import EmbeddingSource, Request
from llm_core.engine.sampling import Sampler, SamplingParams
from llm_core.engine.scheduler import Scheduler, SchedulerConfig
from llm_core.kvcache.prefix_cache import NoPrefixCache, PrefixCache

__all__ = [
    "LLM",
    "DualKVPool",
    "EmbeddingSource",
    "EngineConfig",
    "ErrorKind",
    "KVLayout",
    "LLMEngine",
    "NoPrefixCache",
    "PageAllocator",
    "PrefixCache",
    "Request",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
]
