"""The checkpoint's generation_config.json as the default sampling (vLLM's --generation-config auto):
the six keys read, others and nulls ignored, each value judged by SamplingParams' own rule with the
file named; vllm / none ignore the file, a folder gives another; the override lays JSON over it and
refuses unknown keys; max_new_tokens is the default max_tokens; LLM.generate without params uses
them (equal to passing them), and the checkpoint's own config wins over nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from llm_core import LLM, EngineConfig, SamplingParams
from llm_core.engine.sampling.generation_config import GenerationConfigError, GenerationDefaults, parse_override
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TUNED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "do_sample": True, "num_beams": 4, "eos_token_id": [1, 2], "pad_token_id": None}


def write(folder, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))


def test_auto_reads_the_six_keys_and_ignores_the_rest(tmp_path) -> None:
    write(tmp_path, TUNED)
    d = GenerationDefaults.load(tmp_path)
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (0.6, 0.95, 20, 0.05,
                                                                                                1.1, 64)
    assert d.as_dict() == {k: TUNED[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                  "max_new_tokens")}
    assert d.sampling_params() == SamplingParams(max_tokens=64, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05,
                                                 repetition_penalty=1.1)
    # a served request's default: the server's own setting when given, else max_new_tokens, else 512
    assert d.default_max_tokens() == 64 and d.default_max_tokens(1000) == 1000
    assert GenerationDefaults().default_max_tokens() == 512 and GenerationDefaults().sampling_params().max_tokens == 16
    # no file, vllm / none: the built-in defaults
    assert GenerationDefaults.load(tmp_path / "absent") == GenerationDefaults()
    for setting in ("vllm", "none"):
        assert GenerationDefaults.load(tmp_path, setting) == GenerationDefaults()
    # nulls are absent keys; an empty file is no defaults
    write(tmp_path / "nulls", {"temperature": None, "top_k": 5})
    assert GenerationDefaults.load(tmp_path / "nulls").as_dict() == {"top_k": 5}


def test_a_folder_and_the_override(tmp_path) -> None:
    write(tmp_path / "ckpt", TUNED)
    write(tmp_path / "mine", {"temperature": 0.2})
    d = GenerationDefaults.load(tmp_path / "ckpt", str(tmp_path / "mine"))
    assert d.as_dict() == {"temperature": 0.2} and d.top_p == 1.0  # the folder's file replaces the checkpoint's
    d = GenerationDefaults.load(tmp_path / "ckpt", "auto", '{"temperature": 0, "top_k": -1}')
    assert d.temperature == 0 and d.top_k == -1 and d.top_p == 0.95  # laid over, key by key
    assert GenerationDefaults.load(tmp_path / "ckpt", "vllm", '{"max_new_tokens": 8}').as_dict() == {"max_new_tokens": 8}
    with pytest.raises(GenerationConfigError, match="no generation_config.json there"):
        GenerationDefaults.load(tmp_path / "ckpt", str(tmp_path / "nowhere"))


@pytest.mark.parametrize("data, match", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 2.5}, "top_k must be -1, 0"),
    ({"max_new_tokens": 0}, "max_tokens must be"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ([1, 2], "must hold a JSON object"),
])
def test_a_bad_checkpoint_file_is_an_error_naming_it(tmp_path, data, match) -> None:
    write(tmp_path, data)
    with pytest.raises(GenerationConfigError, match=match) as err:
        GenerationDefaults.load(tmp_path)
    assert "generation_config.json" in str(err.value)
    assert GenerationDefaults.load(tmp_path, "vllm") == GenerationDefaults()  # the way out
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="cannot be read as JSON"):
        GenerationDefaults.load(tmp_path)


def test_the_override_is_checked_when_the_config_is_built() -> None:
    assert EngineConfig(override_generation_config={"top_p": 0.5}).override_generation_config == '{"top_p": 0.5}'
    for bad, match in [('{"temp": 1}', r"unknown key\(s\) temp"), ("[1]", "must be a JSON object"),
                       ("{", "not valid JSON"), ('{"min_p": 2}', r"min_p must be in \[0, 1\]"),
                       ("{" + " " * 5000 + "}", "over 4096 characters")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(override_generation_config=bad)
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config="")
    assert parse_override({"temperature": 0.3}) == {"temperature": 0.3}


@given(st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.1, 3), "max_new_tokens": st.integers(1, 4096),
    "do_sample": st.booleans(), "num_beams": st.integers(1, 4)}))
def test_every_given_key_lands_on_its_field_and_only_those(data) -> None:
    d = GenerationDefaults.from_mapping(data)
    base = GenerationDefaults()
    names = {"max_new_tokens": "max_tokens"}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"):
        field = names.get(key, key)
        assert getattr(d, field) == (data[key] if key in data else getattr(base, field))
    assert set(d.given) == set(data) - {"do_sample", "num_beams"}
    d.sampling_params()  # always valid SamplingParams


def test_llm_generate_without_params_uses_the_checkpoints_defaults(tmp_path) -> None:
    """A greedy generation config (top_k 1) and max_new_tokens 5: LLM.generate with no params gives
    the greedy continuation of 5 tokens, exactly as the explicit params do; vllm ignores the file."""
    ckpt = build_tiny_hf_checkpoint(tmp_path / "hf")
    write(ckpt, {"top_k": 1, "max_new_tokens": 5, "temperature": 0.9})
    engine = dict(page_size=4, num_full_tokens=512, num_swa_tokens=256)
    prompt = [5, 17, 42, 99, 7]
    with LLM(ckpt, **engine) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=5, top_k=1, temperature=0.9)
        by_default = llm.generate([prompt, prompt])
        explicit = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0))
    assert [o.token_ids for o in by_default] == [explicit[0].token_ids] * 2 and len(explicit[0].token_ids) == 5
    with LLM(ckpt, generation_config="vllm", **engine) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(GenerationConfigError, match="no generation_config.json there"):
        LLM(ckpt, generation_config=str(tmp_path / "nowhere"), **engine)
