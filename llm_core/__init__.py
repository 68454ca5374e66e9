"""Text core: hybrid SWA MoE model, dual KV pool, scheduler, sampling, engine and offline API.

    from llm_core import LLM, SamplingParams
"""

from llm_core.dual_pool import DualKVPool, KVLayout, PageAllocator
from llm_core.engine import EngineConfig, LLMEngine
from llm_core.llm import LLM
from llm_core.outputs import RequestOutput
from llm_core.request import EmbeddingSource, Request
from llm_core.sampling import Sampler, SamplingParams
from llm_core.scheduler import NoPrefixCache, PrefixCache, Scheduler, SchedulerConfig

__all__ = [
    "LLM",
    "DualKVPool",
    "EmbeddingSource",
    "EngineConfig",
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
