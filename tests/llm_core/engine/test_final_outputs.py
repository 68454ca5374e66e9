"""Final outputs: ``RequestOutput.text`` says whether it was decoded (None) or is real text ("" too),
a decode that raises while an abort or a scheduler failure is handed out ends only that request, and
LLM.generate leaves no request behind when a later prompt's params are refused."""

from __future__ import annotations

import pytest

from llm_core import ErrorKind, SamplingParams
from tests.llm_core.engine.test_llm_generate import ckpt, drained, engine, ids, model  # noqa: F401 -- fixtures
from tests.llm_core.engine.test_stop_strings import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(eng) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def test_text_is_none_when_not_decoded_and_real_text_otherwise(model):
    prompt = ids(70, 12)
    plain = engine(model).engine
    plain.add_request("r", prompt, SamplingParams(max_tokens=3, **GREEDY))
    outs = run(plain)
    assert [o.text for o in outs] == [None, None, None]  # no tokenizer: never decoded
    toks = outs[-1].token_ids
    text = CharTokenizer().decode(toks)
    eng = engine(model, tokenizer=CharTokenizer()).engine
    eng.add_request("whole", prompt, SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request("cut", prompt, SamplingParams(max_tokens=10, stop=[text[:2]], **GREEDY))
    eng.add_request("empty", [], SamplingParams(max_tokens=3))  # rejected: no output at all
    outs = run(eng)
    assert all(o.text is None for o in outs if not o.finished)
    final = {o.request_id: o for o in outs if o.finished}
    assert final["whole"].text == text
    # the stop string is all there is: the final text is "" -- decoded, not missing
    assert final["cut"].finish_reason == "stop" and final["cut"].text == ""
    assert final["empty"].finish_reason == "error" and final["empty"].text == ""


class FailingTokenizer(CharTokenizer):
    """Raises on any text of 3 tokens or more (a vocabulary file that cannot render some ids)."""

    def decode(self, token_ids, skip_special_tokens=True):
        if len(token_ids) >= 3:
            raise ValueError("cannot decode")
        return super().decode(token_ids)


def test_abort_whose_final_text_fails_to_decode_loses_no_other_output(model):
    eng = engine(model, tokenizer=FailingTokenizer()).engine
    eng.add_request("A", ids(1, 10), SamplingParams(max_tokens=50, **GREEDY))
    while len(eng._live["A"].output_token_ids) < 3:
        eng.step()
    eng.abort("A")
    eng.add_request("B", [], SamplingParams(max_tokens=5))  # an early rejection drained in the same step
    outs = {o.request_id: o for o in eng.step()}  # before: the decode error escaped step(), B was lost
    assert outs["B"].finish_reason == "error" and outs["B"].error_kind is ErrorKind.INVALID_INPUT
    a = outs["A"]
    assert a.finished and a.finish_reason == "error" and a.error_kind is ErrorKind.INTERNAL
    assert "cannot decode" in a.error and a.text == "" and len(a.token_ids) >= 3
    assert not eng.has_unfinished() and drained(eng)


def test_failed_step_whose_final_text_fails_keeps_its_reason(model, monkeypatch):
    """A request whose model step fails ends with "error"; a final decode that raises then must
    neither escape step() (losing the step's other outputs) nor hide why the request ended."""
    import llm_core.engine.llm_engine as llm_engine

    real = llm_engine.run_isolated

    def fail_a(stepper, entries, kv_buffers):  # A's entry fails once A has 3 tokens
        result = real(stepper, entries, kv_buffers)
        bad = [s for s in result.sampled if s.entry.request.request_id == "A" and
               len(s.entry.request.output_token_ids) >= 3]
        for s in bad:
            result.sampled.remove(s)
            result.failed.append((s.entry, RuntimeError("device lost")))
        return result

    monkeypatch.setattr(llm_engine, "run_isolated", fail_a)
    eng = engine(model, tokenizer=FailingTokenizer()).engine
    eng.add_request("A", ids(1, 10), SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("B", ids(2, 10), SamplingParams(max_tokens=2, **GREEDY))
    final = {o.request_id: o for o in run(eng) if o.finished}
    a = final["A"]
    assert a.finish_reason == "error" and a.error_kind is ErrorKind.INTERNAL and "device lost" in a.error
    assert a.text == "" and len(a.token_ids) >= 3
    assert final["B"].finish_reason == "length" and len(final["B"].text) == 2
    assert drained(eng)


def test_generate_aborts_the_prompts_it_queued_when_a_later_one_is_refused(model):
    llm = engine(model)  # no tokenizer: stop strings are refused at add_request
    bad = [SamplingParams(max_tokens=200, **GREEDY), SamplingParams(max_tokens=5, stop=["x"])]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([ids(1, 10), ids(2, 10)], bad)
    eng = llm.engine
    assert not eng.has_unfinished() and not eng._live and not eng.scheduler.running and not eng.scheduler.waiting
    assert drained(eng)
    out = llm.generate([ids(3, 10)], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
