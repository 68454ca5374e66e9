"""Offline API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

    from llm_core import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=64, temperature=0.0, logprobs=1))
    outs[0].token_ids, outs[0].text, outs[0].logprobs, outs[0].finish_reason

Prompts are strings (need a tokenizer in the model dir) or token-id lists. A prompt the engine cannot
serve (too long, unknown ids, empty) comes back with finish_reason "error", ``.error`` saying why and
``.error_kind`` (``ErrorKind`` context_length or invalid_input); the others still finish. ``.text``
is the output text with a tokenizer, None without one (not decoded).
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from llm_core.engine.engine_config import EngineConfig
from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.llm_engine import LLMEngine
from llm_core.engine.outputs import RequestOutput
from llm_core.engine.sampling import SamplingParams
from llm_core.kvcache.page_keys import check_cache_salt
from llm_core.model.dtype import parse_dtype

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path):
    """transformers AutoTokenizer from ``model_dir``, or None when the directory has no tokenizer."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), **_tokenizer_config_hint(model_dir))


def _tokenizer_config_hint(model_dir: Path) -> dict:
    """AutoTokenizer reads config.json only to learn the model type. For a type transformers does
    not know (our checkpoints' ``mimo_v2``) it falls back to a generic config and logs "You are using
    a model of type `mimo_v2` to instantiate a model of type ``" and a ``rope_scaling`` notice. The
    fields that fallback gives the tokenizer lookup, handed over up front, skip the parse and both."""
    path = model_dir / "config.json"
    if not path.is_file():
        return {}
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    raw = json.loads(path.read_text())
    if raw.get("model_type") in CONFIG_MAPPING or "auto_map" in raw:
        return {}  # a config transformers builds itself (no warning), or remote code: let it
    known = {k: raw[k] for k in ("tokenizer_class", "model_name") if k in raw}
    return {"config": PreTrainedConfig(name_or_path=str(model_dir), **known)}


class LLM:
    """Load a checkpoint, own an engine, run batches of prompts to completion."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        tokenizer=None,
        **engine_kwargs,
    ) -> None:
        """``engine_kwargs`` are :class:`EngineConfig` fields (page_size, num_full_tokens, ...);
        ``tensor_parallel_size`` / ``expert_parallel_size`` > 1 start one process per rank here."""
        from llm_core.distributed.launcher import load_text_model

        config = EngineConfig(**engine_kwargs)
        # the checkpoint's generation_config.json (bad: an error now, before the weights load)
        self.generation_defaults = GenerationDefaults.load(model_dir, config.generation_config,
                                                           config.override_generation_config)
        model = load_text_model(model_dir, device=device, dtype=parse_dtype(dtype),
                                tensor_parallel_size=config.tensor_parallel_size,
                                expert_parallel_size=config.expert_parallel_size,
                                distributed_timeout_s=config.distributed_timeout_s,
                                fp8_experts=config.fp8_experts, load_mtp=config.loads_mtp)
        try:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
            self.engine = LLMEngine(model, config, tokenizer=self.tokenizer)
        except BaseException:
            getattr(model, "close", lambda: None)()
            raise
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine's background work and, under tensor / expert parallelism, the other ranks."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (tests, benchmarks)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer, llm._next_id = engine, engine.tokenizer, 0
        llm.generation_defaults = GenerationDefaults.load(None, "none", engine.config.override_generation_config)
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling ``generate`` uses without ``sampling_params`` -- the checkpoint's
        generation_config.json defaults (``generation_config`` / ``override_generation_config``)."""
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (batched by the engine); outputs in prompt order. ``priority``:
        one per prompt, lower first, under the ``priority`` queue policy (vLLM's argument).
        ``cache_salt``: these prompts share prefix-cache KV only with prompts of the same salt."""
        prompts = as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        for problem in filter(None, map(self.engine.check_priority, priorities)):
            raise ValueError(problem.message)
        if (salt_problem := check_cache_salt(cache_salt)) is not None:
            raise ValueError(salt_problem)
        token_lists = [self._tokens(p) for p in prompts]  # tokenize everything before queueing
        ids = []
        try:
            for tokens, p, rank in zip(token_lists, params, priorities):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                # raises on bad params (e.g. stop without a tokenizer)
                self.engine.add_request(rid, tokens, p, priority=rank, cache_salt=cache_salt)
                ids.append(rid)
        except Exception:
            # the prompts queued before it would run on, unseen, inside the next call: abort them and
            # take their final outputs, so the engine is left as before the call
            for rid in ids:
                self.engine.abort(rid)
            self._run_until_finished(ids)
            raise
        final = self._run_until_finished(ids)
        return [final[r] for r in ids]

    def _run_until_finished(self, ids: list[str]) -> dict[str, RequestOutput]:
        """Step the engine until every request of ``ids`` finished; their final outputs by id."""
        left, final = set(ids), {}
        while left:
            for out in self.engine.step():
                if out.finished and out.request_id in left:
                    final[out.request_id] = out
                    left.discard(out.request_id)
        return final

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model directory has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        return prompt


_ACCEPTED = "a string or token ids (a list of ints, a 1-D integer tensor or NumPy array)"


def as_prompt_list(prompts) -> list[str | list[int]]:
    """``generate``'s prompts as a list of strings and token-id lists of Python ints: one prompt (a
    string, token ids of any accepted form) or a sequence of them. Anything else is a TypeError naming
    what was given, raised before any prompt is queued (a tensor's elements are 0-d tensors, not
    ints: without this a bare tensor was read as a list of one-token prompts)."""
    if not isinstance(prompts, (Sequence, torch.Tensor, np.ndarray)):
        raise TypeError(f"prompts must be {_ACCEPTED}, or a list of them; got {type(prompts).__name__}")
    if isinstance(prompts, str) or (len(prompts) > 0 and _token_ids(prompts) is not None):
        prompts = [prompts]  # one prompt (an empty list is no prompts)
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        tokens = p if isinstance(p, str) else _token_ids(p)
        if tokens is None:
            raise TypeError(f"prompt {i} must be {_ACCEPTED}; got {_describe(p)}")
        out.append(tokens)
    return out


def _token_ids(x) -> list[int] | None:
    """``x`` as one token-id prompt (Python ints), or None when it is not one. An empty list is one
    (the engine reports it as an empty prompt, as any prompt it cannot serve)."""
    if isinstance(x, torch.Tensor):
        is_int = not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
        return [int(t) for t in x.tolist()] if x.ndim == 1 and is_int else None
    if isinstance(x, np.ndarray):
        return [int(t) for t in x.tolist()] if x.ndim == 1 and np.issubdtype(x.dtype, np.integer) else None
    if isinstance(x, Sequence) and not isinstance(x, str) and all(isinstance(t, numbers.Integral) for t in x):
        return [int(t) for t in x]  # NumPy integers too
    return None


def _describe(x) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"a {x.ndim}-D {type(x).__name__} of {x.dtype}"
    return type(x).__name__
