"""The checkpoint's generation config through the server (vLLM's --generation-config auto, on by
default): a request's unset sampling fields take the model's values and its own values win (property,
over every field); over HTTP a greedy, 4-token generation config answers a bare request as explicit
greedy 4-token params do, on chat and completions; MultimodalLLM's default params are the model's;
a bad --generation-config is a usage error naming it."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings, strategies as st

from llm_core import SamplingParams
from llm_core.engine.sampling.generation_config import GenerationDefaults
from mm_pipeline.server.completions.request_params import sampling_params
from mm_pipeline.server.protocol import ChatCompletionRequest
from tests.support.served import served_client

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
          "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2)}


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional={**FIELDS, "max_new_tokens": st.integers(1, 1000)}),
       st.fixed_dictionaries({}, optional={**FIELDS, "max_tokens": st.integers(1, 1000)}))
def test_a_request_field_wins_and_an_unset_one_takes_the_models(model_side, request_side) -> None:
    defaults = GenerationDefaults.from_mapping(model_side)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **request_side)
    p = sampling_params(req, None, 0, None, defaults=defaults)  # no --default-max-tokens given
    for name in FIELDS:
        assert getattr(p, name) == request_side.get(name, model_side.get(name, getattr(SamplingParams(), name)))
    assert p.max_tokens == request_side.get("max_tokens", model_side.get("max_new_tokens", 512))
    assert sampling_params(req, None, 0, 77, defaults=defaults).max_tokens == request_side.get("max_tokens", 77)


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    ckpt = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("gen") / "m")
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4,
                                                             "repetition_penalty": 1.1, "do_sample": False}))
    return ckpt


def test_the_server_answers_a_bare_request_with_the_models_sampling(greedy_checkpoint, tmp_path, caplog) -> None:
    from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig

    engine = OmniEngine.from_pretrained(greedy_checkpoint, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=2048, num_swa_tokens=1024))
    try:
        assert engine.generation_defaults.as_dict() == {"temperature": 0.0, "max_new_tokens": 4,
                                                        "repetition_penalty": 1.1}
        from mm_pipeline.runtime.startup_summary import describe_engine  # what `mmserve serve` prints at start-up

        lines = "\n".join(describe_engine(engine, greedy_checkpoint))
        assert ("sampling  defaults: temperature 0.0, max_new_tokens 4, repetition_penalty 1.1 from the "
                "model's generation config" in lines)
        assert "\ndecoding  " in lines  # whether MTP speculative decoding is on says so too
        with caplog.at_level("INFO", logger="mm_pipeline.server.app"), \
                served_client(engine, str(tmp_path)) as client:
            chat = {"messages": [{"role": "user", "content": "Tell me about circles."}]}
            bare = [client.post("/v1/chat/completions", json={**chat, "seed": s}).json() for s in (1, 2)]
            explicit = client.post("/v1/chat/completions", json={**chat, "temperature": 0, "max_tokens": 4}).json()
            texts = {b["choices"][0]["message"]["content"] for b in bare}
            assert texts == {explicit["choices"][0]["message"]["content"]}  # greedy: seeds do not matter
            assert all(b["usage"]["completion_tokens"] <= 4 for b in bare)
            longer = client.post("/v1/chat/completions", json={**chat, "max_tokens": 7, "ignore_eos": True}).json()
            assert longer["usage"]["completion_tokens"] == 7  # the request's own value wins over the cap
            text = {"prompt": "Circles and squares", "ignore_eos": True}
            done = client.post("/v1/completions", json=text).json()
            assert done["usage"]["completion_tokens"] == 4 and done["choices"][0]["finish_reason"] == "length"
            greedy = client.post("/v1/completions", json={**text, "temperature": 0, "max_tokens": 4}).json()
            assert done["choices"][0]["text"] == greedy["choices"][0]["text"]
            # the Responses API answers as a chat and echoes the sampling it used
            answer = client.post("/v1/responses", json={"input": "Tell me about circles."}).json()
            assert (answer["temperature"], answer["top_p"]) == (0.0, 1.0)
            assert answer["output"][-1]["content"][0]["text"] == explicit["choices"][0]["message"]["content"]
        assert "sampling defaults: temperature 0.0, max_new_tokens 4, repetition_penalty 1.1 from the model's " \
               "generation config" in caplog.text
        # the caption job: its own length and greedy temperature over the model's other fields
        from mm_pipeline.jobs.caption import CaptionJob
        from tests.support.media_samples import image_bytes

        (tmp_path / "cat.png").write_bytes(image_bytes("PNG"))
        seen, generate = [], engine.generate
        engine.generate = lambda messages, params, **kw: seen.append(params) or generate(messages, params, **kw)
        assert asyncio.run(CaptionJob(engine).run([str(tmp_path / "cat.png")], tmp_path / "c.jsonl")).failed == 0
        assert (seen[0].max_tokens, seen[0].temperature, seen[0].repetition_penalty) == (64, 0.0, 1.1)
    finally:
        engine.shutdown()


def test_offline_and_cli_settings(greedy_checkpoint, tmp_path, capsys) -> None:
    from mm_pipeline import cli
    from mm_pipeline.multimodal_llm import MultimodalLLM

    engine = dict(page_size=4, num_full_tokens=1024, num_swa_tokens=512)
    with MultimodalLLM(greedy_checkpoint, **engine) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=4, temperature=0.0,
                                                                   repetition_penalty=1.1)
        out = llm.chat([{"role": "user", "content": "Hello"}])
        assert 1 <= len(out[0].token_ids) <= 4
    with MultimodalLLM(greedy_checkpoint, generation_config="vllm",
                       override_generation_config='{"top_p": 0.5}', **engine) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_p=0.5)
    with MultimodalLLM(greedy_checkpoint, override_generation_config='{"top_p": 0.5}', **engine) as llm:
        assert llm.engine.generation_defaults.describe() == (
            "temperature 0.0, max_new_tokens 4, repetition_penalty 1.1 from the model's generation config; "
            "top_p 0.5 from --override-generation-config")  # each value says where it came from
    # a default no request may send (requests take temperature <= 2) is a usage error before the
    # model loads: every request leaving it unset would get it
    assert cli.main(["serve", "--model", str(greedy_checkpoint), "--override-generation-config",
                     '{"temperature": 5}', "--port", "70000"]) == 2  # (a bad port: never a live server)
    assert ("the sampling default temperature 5 (from --override-generation-config) is not a value a request "
            "may send" in capsys.readouterr().err)
    assert cli.main(["serve", "--model", str(greedy_checkpoint), "--generation-config", str(tmp_path / "none")]) == 2
    assert "no generation_config.json there" in capsys.readouterr().err
    # a --config file gives the override as a mapping (YAML), taken as its JSON text: parsed and
    # checked (the run gets as far as the folder), or refused naming the key
    (tmp_path / "ok.yaml").write_text("override_generation_config: {temperature: 0.3, top_k: 7}\n")
    assert cli.main(["serve", "--model", str(greedy_checkpoint), "--config", str(tmp_path / "ok.yaml"),
                     "--generation-config", str(tmp_path / "none")]) == 2
    assert "no generation_config.json there" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("override_generation_config: {tempo: 0.3}\n")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", str(greedy_checkpoint), "--config", str(tmp_path / "bad.yaml")])
    assert "unknown key(s) tempo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as parse:  # the flag's own check: argparse refuses it
        cli.main(["serve", "--model", str(greedy_checkpoint), "--override-generation-config", '{"temp": 1}'])
    assert parse.value.code == 2 and "unknown key(s) temp" in capsys.readouterr().err
