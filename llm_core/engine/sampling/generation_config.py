"""GenerationDefaults: the sampling a checkpoint recommends, used where a request leaves a field unset.

A Hugging Face checkpoint may ship ``generation_config.json`` next to ``config.json``: the sampling its
authors tuned the model for (a reasoning model's ``temperature: 0.6, top_p: 0.95``, say). vLLM and
SGLang apply it by default (vLLM's ``--generation-config auto``, SGLang's ``--sampling-defaults model``),
so a client that sends no ``temperature`` gets the model's, not 1.0. We do the same, reading the six
keys vLLM reads:

    temperature, top_p, top_k, min_p, repetition_penalty   -> the request's field of that name
    max_new_tokens                                         -> the default max_tokens

Only keys present in the file count (a key absent, or null, keeps the built-in default); every other
key (``do_sample``, ``num_beams``, the special token ids) is ignored, as vLLM ignores it -- the engine
has no beam search, and ``do_sample: false`` beside a temperature is a checkpoint's contradiction a
request settles with ``temperature: 0``. A request's own value always wins.

``setting``: ``"auto"`` (the checkpoint's file when it has one), ``"vllm"`` or ``"none"`` (built-in
defaults only: vLLM's name for it), or a folder holding a ``generation_config.json``. ``override``: a
JSON object of the same keys laid over whatever the setting gave (vLLM's
``--override-generation-config``). A bad file or value is a ``GenerationConfigError`` naming the
file and key, raised when the engine loads -- not a 400 on every request later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from llm_core.engine.sampling import SamplingParams
from llm_core.json_setting import json_object_setting

FILE_NAME = "generation_config.json"
BUILTIN_SETTINGS = ("vllm", "none")  # no checkpoint defaults ("vllm": vLLM's spelling)
# generation_config key -> the SamplingParams field it is the default of (whose own check judges it)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
KEYS = tuple(_FIELDS)
# a served request's max_tokens when neither it, the server (--default-max-tokens) nor the model's
# generation config gives one (vLLM's default is the context's room; a chat server's answers are
# bounded here so a client that forgets max_tokens does not hold a seat for a whole context)
DEFAULT_MAX_TOKENS = 512
MAX_OVERRIDE_CHARS = 4096


class GenerationConfigError(ValueError):
    """A generation config (the checkpoint's file, a folder's, or the override) that cannot be used."""


@dataclass(frozen=True)
class GenerationDefaults:
    """The default of each sampling field (built-in unless the generation config set it).
    ``max_tokens``: None, or ``max_new_tokens``: a request's max_tokens when neither it nor the
    server's own setting gives one.
    ``given``: the keys the generation config set (for the start-up log line), in file order."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    given: tuple[str, ...] = ()
    # (key, where its value came from) for the given keys: the start-up line and errors name it
    origins: tuple[tuple[str, str], ...] = ()

    @classmethod
    def load(cls, model_dir: str | Path | None, setting: str = "auto", override: str | None = None
             ) -> "GenerationDefaults":
        """The defaults ``setting`` and ``override`` give for the checkpoint at ``model_dir`` (module doc)."""
        values: dict[str, Any] = {}
        origin = "the model's generation config"
        if setting == "auto":
            path = None if model_dir is None else Path(model_dir) / FILE_NAME
            if path is not None and path.is_file():
                values = _read(path)
        elif setting not in BUILTIN_SETTINGS:
            path = Path(setting) / FILE_NAME
            if not path.is_file():
                raise GenerationConfigError(f"generation_config {setting!r}: no {FILE_NAME} there "
                                            f"(give auto, vllm, none or a folder holding one)")
            values, origin = _read(path), str(path)
        origins = {key: origin for key in values}
        if override is not None:
            overridden = parse_override(override)
            values.update(overridden)
            origins.update((key, "--override-generation-config") for key in overridden)
        return cls.from_mapping(values, origins=origins)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "generation config",
                     origins: Mapping[str, str] | None = None) -> "GenerationDefaults":
        """Defaults from generation-config keys (others ignored, null values skipped), each checked;
        ``origins``: where each key's value came from."""
        fields: dict[str, Any] = {}
        given = []
        for key, value in values.items():
            if key not in _FIELDS or value is None:
                continue
            name = _FIELDS[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GenerationConfigError(f"{where}: {key} must be a number, got {value!r}")
            try:
                SamplingParams(**{name: value})  # the engine's rule for the field, not a copy of it
            except ValueError as exc:
                raise GenerationConfigError(f"{where}: {key}: {exc}") from None
            fields[name] = value
            given.append(key)
        return cls(**fields, given=tuple(given),
                   origins=tuple((key, (origins or {}).get(key, where)) for key in given))

    def describe(self) -> str:
        """``temperature 0.6, top_p 0.95 from the model's generation config; max_new_tokens 64 from
        --override-generation-config``: each value set, with where it came from (start-up lines)."""
        by_origin: dict[str, list[str]] = {}
        for key, value in self.as_dict().items():
            by_origin.setdefault(self.origin_of(key), []).append(f"{key} {value}")
        return "; ".join(f"{', '.join(keys)} from {origin}" for origin, keys in by_origin.items())

    def origin_of(self, key: str) -> str:
        """Where ``key``'s default came from (a generation-config key name)."""
        return dict(self.origins).get(key, "built in")

    def as_dict(self) -> dict[str, Any]:
        """The keys the generation config set, by their generation-config names (for logs)."""
        return {key: getattr(self, _FIELDS[key]) for key in self.given}

    def sampling_params(self) -> SamplingParams:
        """Default SamplingParams (vLLM's ``LLM.get_default_sampling_params``): these defaults, and
        ``max_new_tokens`` as max_tokens (else SamplingParams' own default, 16)."""
        return SamplingParams(max_tokens=16 if self.max_tokens is None else self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty)

    def default_max_tokens(self, given: int | None = None) -> int:
        """A served request's max_tokens when it gives none: ``given`` (the server's
        --default-max-tokens) when set, else the generation config's ``max_new_tokens`` (as vLLM
        takes it), else DEFAULT_MAX_TOKENS. The engine stops at the context's end in any case."""
        if given is not None:
            return given
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


def parse_override(text: str | Mapping[str, Any]) -> dict[str, Any]:
    """``--override-generation-config``: a JSON object of generation-config keys (a mapping is taken
    as it is: a YAML config file gives one). Unknown keys are refused here (a typo would otherwise be
    silently ignored), values are checked by ``GenerationDefaults.from_mapping``."""
    data = json_object_setting(text, "override_generation_config", known=_FIELDS, max_chars=MAX_OVERRIDE_CHARS,
                               error=GenerationConfigError)
    GenerationDefaults.from_mapping(data, "override_generation_config")  # checked now, not at load
    return data


def _read(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > 1 << 20:
            raise GenerationConfigError(f"{path}: over 1 MiB, not a generation config")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object")
    GenerationDefaults.from_mapping(data, str(path))  # named after the file when a value is bad
    return data
