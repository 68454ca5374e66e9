"""How a request's next token is chosen: its parameters (params.py), the logits processing the
parameters ask for (logits_processing.py), the batched sampler (sampler.py), prompt logprobs
(prompt_logprobs.py) and the defaults a checkpoint's generation_config.json gives them
(generation_config.py)."""

from llm_core.engine.sampling.params import SamplingParams
from llm_core.engine.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingParams"]
