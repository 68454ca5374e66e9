"""Structured outputs in the engine (llm_core/engine/structured/): a tiny random MiMo-V2 model with the
demo checkpoint's tokenizer (its 336 tokens fit the model's 512).

- greedy under a grammar equals transformers' generate with xgrammar's own logits processor (the
  reference), token for token, and every constraint kind (schema, json_object, regex, choice,
  EBNF) gives output its constraint accepts, greedy and sampled, ending with "stop";
- an unconstrained row of the same batch gets its solo tokens; ignore_eos and min_tokens yield to
  the grammar; the MTP-speculative engine gives the non-speculative tokens;
- a bad constraint is an "error" output naming it and the engine goes on; a slow compile is killed
  at its time limit and the next compile starts a fresh worker; the cache is bounded; the phases
  of the reasoning gate; the params' own checks.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.engine.structured import ReasoningGate, StructuredOutputsParams
from llm_core.engine.structured.compiler import GrammarCompiler, GrammarError
from llm_core.engine.structured.grammar_state import GrammarState, Phase
from llm_core.engine.structured.params import MAX_CHOICES, MAX_CONSTRAINT_CHARS
from llm_core.llm import load_tokenizer
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (DEMO_MODEL / "tokenizer.json").is_file(), reason="samples/demo-model missing")]

# a finite language: generation must end in "stop" however random the model
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}}}
FINITE = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
          StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}"),
          StructuredOutputsParams(choice=("yes", "no", 'a "quoted"\nline')),
          StructuredOutputsParams(grammar='root ::= "ab" ("c" | "d") "e"')]


def accepted(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.kind == "json":
        value = json.loads(text)
        return set(value) == {"color", "n"} and value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 9
    if spec.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if spec.kind == "regex":
        return re.fullmatch(spec.regex, text) is not None
    if spec.kind == "choice":
        return text in spec.choice
    return re.fullmatch("ab[cd]e", text) is not None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", eos_token_id=EOS)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """One compiler (one worker process start, ~3 s) for the tests that drive it directly."""
    compiler = GrammarCompiler(tokenizer, 512, [EOS])
    yield compiler
    compiler.close()


def make_llm(model, tokenizer, **kw) -> LLM:
    cfg = dict(page_size=4, max_chunk_tokens=8, max_num_batched_tokens=16, num_full_tokens=2048, num_swa_tokens=512)
    return LLM.from_engine(LLMEngine(model, EngineConfig(**{**cfg, **kw}), tokenizer=tokenizer))


@pytest.fixture(scope="module")
def llm(model, tokenizer):
    llm = make_llm(model, tokenizer)
    yield llm
    llm.engine.close()


PROMPT = [5, 6, 7, 8, 9, 10, 11]
EOS = 258  # the demo tokenizer's <|im_end|>, a special token: not in the text


def test_greedy_equals_transformers_with_xgrammars_logits_processor(ckpt, llm):
    import transformers
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    hf.generation_config.pad_token_id = 0
    eos = list(llm.engine.model_config.eos_token_ids)
    for spec in [*FINITE, StructuredOutputsParams(json_object=True)]:
        ours = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=spec))[0]
        compiled = llm.engine.grammars.compile(spec)
        with torch.no_grad():
            seq = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                              logits_processor=[LogitsProcessor(compiled)])[0, len(PROMPT):].tolist()
        assert ours.token_ids == seq, spec.kind
        assert isinstance(compiled, xgr.CompiledGrammar)
        if spec.kind != "json_object":  # the finite ones always end, and in their language
            assert ours.finish_reason == "stop" and accepted(spec, ours.text), (spec.kind, ours.text)


def test_every_kind_greedy_and_sampled_stays_in_its_language(llm):
    for spec in FINITE:
        params = [SamplingParams(max_tokens=40, temperature=t, seed=s, structured_outputs=spec)
                  for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))]
        for p in params:
            out = llm.generate([PROMPT], p)[0]
            assert out.finish_reason == "stop" and accepted(spec, out.text), (spec.kind, p.temperature, out.text)
    # json_object: the output, once it ends, is an object (a random model may run to max_tokens)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=60, temperature=1.0, seed=7,
                                                structured_outputs=StructuredOutputsParams(json_object=True)))[0]
    assert out.text.lstrip().startswith("{")
    if out.finish_reason == "stop":
        assert accepted(StructuredOutputsParams(json_object=True), out.text)


def test_properties_come_in_the_order_the_schema_lists_them(llm):
    """OpenAI's rule (a "reasoning" property listed before "answer" is written first): the schema is
    compiled as given, never with its keys sorted."""
    props = {"zeta": {"enum": ["z"]}, "alpha": {"enum": ["a"]}, "mid": {"type": "integer", "minimum": 0, "maximum": 9}}
    spec = StructuredOutputsParams(json={"type": "object", "additionalProperties": False, "required": list(props),
                                         "properties": props}, disable_any_whitespace=True)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec))[0]
    assert out.finish_reason == "stop" and list(json.loads(out.text)) == ["zeta", "alpha", "mid"], out.text


def test_an_unconstrained_row_of_the_batch_gets_its_solo_tokens(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = llm.generate([PROMPT[::-1]], free)[0].token_ids
    spec = FINITE[0]
    outs = llm.generate([PROMPT, PROMPT[::-1]],
                        [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=spec), free])
    assert outs[1].token_ids == solo
    assert accepted(spec, outs[0].text)


def test_ignore_eos_and_min_tokens_yield_to_the_grammar(llm):
    spec = StructuredOutputsParams(choice=("yes", "no"))
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=spec))[0]
    for extra in (dict(ignore_eos=True), dict(min_tokens=8)):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=spec,
                                                    **extra))[0]
        assert out.finish_reason == "stop" and out.token_ids == plain.token_ids, extra


def test_the_speculative_engine_gives_the_plain_tokens(tmp_path, tokenizer):
    ckpt = build_tiny_hf_checkpoint(tmp_path / "mtp", mtp_layers=1, eos_token_id=EOS)
    model = load_model(ckpt, dtype=torch.float32)
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=FINITE[0]),
              SamplingParams(max_tokens=30, temperature=1.0, seed=3, structured_outputs=FINITE[1]),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    prompts = [PROMPT, PROMPT[1:], PROMPT[::-1]]
    plain = make_llm(model, tokenizer, speculative_tokens=0).generate(prompts, params)
    spec = make_llm(model, tokenizer, speculative_tokens=2).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert accepted(FINITE[0], plain[0].text) and accepted(FINITE[1], plain[1].text)


def test_a_bad_constraint_is_an_error_output_and_the_engine_goes_on(llm, model):
    bad = [StructuredOutputsParams(regex="(ab"), StructuredOutputsParams(grammar="root ::= undefined_rule"),
           StructuredOutputsParams(json='{"type": "nonsense"}')]
    for spec in bad:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=spec))[0]
        assert out.finish_reason == "error" and f"structured_outputs.{spec.kind}" in out.error, out.error
        assert out.token_ids == []
    ok = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=FINITE[2]))[0]
    assert ok.finish_reason == "stop"
    llm.engine.prefix_cache.clear()
    assert llm.engine.pool.all_free()
    # an engine without a tokenizer, or with the backend off, refuses the request the same way
    for off in (make_llm(model, None), make_llm(model, load_tokenizer(DEMO_MODEL), structured_outputs_backend="none")):
        out = off.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=FINITE[2]))[0]
        assert out.finish_reason == "error" and "structured outputs are off" in out.error


def test_a_slow_compile_is_killed_at_its_limit_and_the_next_one_works(tokenizer):
    compiler = GrammarCompiler(tokenizer, 512, [EOS], timeout_s=1.0)
    try:
        compiler.compile(FINITE[1])  # the worker is up (its start is not part of the limit below)
        worker = compiler._proc
        hostile = StructuredOutputsParams(json={"type": "string", "pattern": "(a|b)*c{1,50000}"})  # ~270 s
        with pytest.raises(GrammarError, match="took longer than 1 s"):
            compiler.compile(hostile)
        assert worker.poll() is not None  # killed, not left running
        assert compiler.counts["timeouts"] == 1
        compiler.compile(FINITE[0])
        assert compiler.counts["worker_starts"] == 2
    finally:
        compiler.close()


def test_the_compile_cache_is_shared_and_bounded(compiler, monkeypatch):
    monkeypatch.setattr(compiler, "cache_entries", 2)
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert as_dict == as_text and hash(as_dict) == hash(as_text)  # canonical JSON text
    before = compiler.counts["compiles"]
    first = compiler.compile(as_dict)
    assert compiler.compile(as_text) is first and compiler.counts["compiles"] == before + 1
    for spec in FINITE[1:]:
        compiler.compile(spec)
    assert len(compiler._cache) == 2 and compiler.counts["compiles"] == before + 4


def test_the_reasoning_gate_lets_thinking_run_and_holds_the_answer(tokenizer, compiler):
    import xgrammar as xgr

    gate = ReasoningGate(start_id=268, end_id=269, boundary_ids=frozenset({256, 258}))
    spec = StructuredOutputsParams(regex="[0-9]", reasoning=gate)
    compiled = compiler.compile(spec)
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}

    def allowed(state: GrammarState) -> set[int]:
        bitmask = xgr.allocate_token_bitmask(1, 512)
        state.fill(bitmask, 0)
        logits = torch.zeros(1, 512)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())

    # the prompt does not open thinking: the grammar's tokens or <think>
    state = GrammarState(compiled, spec, [256, 10, 11])
    assert state.phase is Phase.START and allowed(state) == digits | {268}
    state.accept(268)
    assert state.phase is Phase.FREE and allowed(state) == set(range(512)) - {258}  # no stop while thinking
    state.accept(40)
    state.accept(269)
    assert state.phase is Phase.ANSWER and allowed(state) == digits
    state.accept(min(digits))
    assert allowed(state) == {258} and not state.terminated
    state.accept(258)
    assert state.terminated
    # a prompt that ends inside <think> starts free; one that closed it (<think></think>) holds at once
    assert GrammarState(compiled, spec, [256, 10, 268]).phase is Phase.FREE
    closed = GrammarState(compiled, spec, [256, 10, 268, 269])
    assert closed.phase is Phase.ANSWER and allowed(closed) == digits
    assert GrammarState(compiled, spec, [268, 256, 10]).phase is Phase.START  # before the last boundary
    no_gate = StructuredOutputsParams(regex="[0-9]")
    state = GrammarState(compiled, no_gate, [256, 10, 268])
    assert state.phase is Phase.ANSWER
    with pytest.raises(ValueError, match="does not follow"):
        state.accept(268)


def test_params_checks():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="must be a JSON schema"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=("a", ""))
    with pytest.raises(ValueError, match="list of strings"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(ValueError, match=f"1 to {MAX_CHOICES}"):
        StructuredOutputsParams(choice=tuple(str(i) for i in range(MAX_CHOICES + 1)))
    with pytest.raises(ValueError, match="at most"):
        StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    assert p.processes_logits and not SamplingParams().processes_logits
    assert StructuredOutputsParams(json_object=True).text == ""
