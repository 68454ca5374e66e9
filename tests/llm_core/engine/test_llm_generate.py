"""End to end: LLM.generate over the dual pool == transformers generate; batching, preemption,
SWA bounds, pool hygiene, a failing forward,
ready work, streaming embeddings, bad input (stop conditions: test_stop_strings.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from llm_core import LLM, EngineConfig, ErrorKind, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

WINDOW = 8  # tiny checkpoint: visible keys incl. the query
PAGE = 4
CHUNK = 5  # smaller than the window and not aligned to it or to the page


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype=torch.float32)


def drained(eng: LLMEngine) -> bool:
    """Every page free once the prefix cache (on by default) lets go of what it keeps: no leak."""
    eng.prefix_cache.clear()
    return eng.pool.all_free()


def engine(model, tokenizer=None, **kw) -> LLM:
    cfg = dict(page_size=PAGE, max_chunk_tokens=CHUNK, max_num_batched_tokens=16, num_full_tokens=2048,
               num_swa_tokens=512)
    return LLM.from_engine(LLMEngine(model, EngineConfig(**{**cfg, **kw}), tokenizer=tokenizer))


@pytest.fixture(scope="module")
def hf_model(ckpt):
    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # run the full length; our side uses ignore_eos
    hf.generation_config.pad_token_id = 0
    return hf


def hf_generate(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]
    return toks, lps


def test_greedy_matches_transformers_generate(model, hf_model):
    prompts = [ids(1, 27), ids(2, 41), ids(3, 50)]  # all > 3 windows
    llm = engine(model)
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, logprobs=2, ignore_eos=True))
    for p, out in zip(prompts, outs):
        ref_toks, ref_lps = hf_generate(hf_model, p, 64)
        assert out.finish_reason == "length" and out.prompt_token_ids == p
        assert out.token_ids == ref_toks
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-3
        assert all(len(t) == 2 and max(t.values()) == pytest.approx(lp, abs=1e-6) or lp < max(t.values())
                   for t, lp in zip(out.top_logprobs, out.logprobs))
        assert out.num_cached_tokens == 0
    assert drained(llm.engine)


def test_mixed_batch_equals_each_alone(model):
    lengths = [3, 30, 9, 44, 1, 17, 25, 12]
    prompts = [ids(10 + i, n) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = engine(model).generate(prompts, params)
    for p, b in zip(prompts, batched):
        alone = engine(model).generate([p], params)[0]
        assert b.token_ids == alone.token_ids


def test_seeded_sampling_batched_equals_alone(model):
    prompts = [ids(30 + i, 10 + 7 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    batched = engine(model).generate(prompts, params)
    for p, sp, b in zip(prompts, params, batched):
        assert b.token_ids == engine(model).generate([p], sp)[0].token_ids


def test_swa_high_water_bounded_independent_of_length(model):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    peaks = []
    for n in (30, 90):
        llm = engine(model, swa_release_interval=4, enable_prefix_caching=False)  # the request alone
        llm.generate([ids(n, n)], params)
        peaks.append(llm.engine.pool.swa.peak_used)
        assert drained(llm.engine)
        llm.engine.pool.check_integrity()
    bound_tokens = WINDOW + max(CHUNK, 4) + 2 * PAGE  # window + one chunk + page rounding at both ends
    assert all(p * PAGE <= bound_tokens for p in peaks)
    assert max(peaks) <= min(peaks) + 1


def test_preemption_under_tiny_pool_gives_identical_tokens(model):
    prompts = [ids(50 + i, 20 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = engine(model).generate(prompts, params)
    tight = engine(model, num_full_tokens=96, num_swa_tokens=64)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert drained(tight.engine)


def test_a_context_past_the_models_positions_is_refused(model):
    """As vLLM: max_model_len above max_position_embeddings is an error naming both, not silently
    lowered; at the limit or below it is taken as given."""
    from llm_core.engine.engine_config import ContextLimitError

    limit = model.config.max_position_embeddings
    with pytest.raises(ContextLimitError, match=f"max_model_len {limit + 1} .* limit of {limit} tokens"):
        engine(model, max_model_len=limit + 1)
    assert engine(model, max_model_len=limit).engine.max_model_len == limit
    assert engine(model).engine.max_model_len == limit


def test_bad_requests_error_alone_and_others_finish(model):
    llm = engine(model, max_model_len=64)
    good = ids(60, 10)
    outs = llm.generate([good, ids(61, 80), [], [5, 99999, 7], good], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "context limit of 64" in outs[1].error
    assert "empty prompt" in outs[2].error
    assert "99999" in outs[3].error
    assert [o.error_kind for o in outs] == [None, ErrorKind.CONTEXT_LENGTH, ErrorKind.INVALID_INPUT,
                                            ErrorKind.INVALID_INPUT, None]
    assert outs[0].token_ids and outs[0].error is None
    assert drained(llm.engine) and not llm.engine.has_unfinished()


def test_a_model_step_that_raises_ends_its_batch_as_internal(model):
    llm = engine(model)
    forward, calls = model.forward, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return forward(*args, **kwargs)

    model.forward = fails_once
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        failed = llm.generate([ids(70, 6), ids(71, 4)], params)
        after = llm.generate([ids(70, 6)], params)[0]
    finally:
        del model.forward
    for out in failed:  # both were in the step that raised; neither is blamed on its prompt
        assert out.finish_reason == "error" and out.error_kind is ErrorKind.INTERNAL
        assert "RuntimeError: device fell over" in out.error
    assert after.finish_reason == "length" and after.error_kind is None  # the engine kept serving
    assert drained(llm.engine) and not llm.engine.has_unfinished()


def test_generation_stops_at_context_limit(model):
    llm = engine(model, max_model_len=40)
    out = llm.generate([ids(62, 30)], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_invalid_params_and_text_without_tokenizer_raise(model):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    llm = engine(model)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished()


class FailingOnce(torch.nn.Module):
    """The model, except that its first forward raises."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner, self.failed = model, False

    def forward(self, *args, **kw):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return self.inner(*args, **kw)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def test_a_failing_forward_ends_its_batch_and_the_engine_keeps_serving(model):
    llm = engine(model)
    eng = llm.engine
    eng.runner.model = FailingOnce(model)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng.add_request("a", ids(73, 9), params)
    eng.add_request("b", ids(74, 3), params)
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finish_reason == outs["b"].finish_reason == "error"
    assert outs["a"].error == "RuntimeError: boom" and not eng.has_unfinished()
    assert drained(eng)
    again = llm.generate([ids(73, 9)], params)[0]
    alone = engine(model).generate([ids(73, 9)], params)[0]
    assert again.finish_reason == "length" and again.token_ids == alone.token_ids


def test_has_ready_work_follows_queues_and_embedding_readiness(model):
    eng = engine(model, max_model_len=64).engine
    assert not eng.has_ready_work()
    eng.add_request("long", ids(75, 80), SamplingParams())  # rejected at once: the output is ready work
    assert eng.has_ready_work()
    (out,) = eng.step()
    assert out.finish_reason == "error" and not eng.has_ready_work()
    table = model.model.embed_tokens.weight.detach()
    media = StreamingEmbeds(table, ids(76, 20), step=0)  # nothing ready until the frontier moves
    eng.add_request("m", ids(76, 20), SamplingParams(max_tokens=2, ignore_eos=True), embeds=media)
    assert eng.has_ready_work()
    assert eng.step() == [] and eng.last_step_progressed  # admitted, nothing computable yet
    assert not eng.has_ready_work()
    assert eng.step() == [] and not eng.last_step_progressed  # a step now would spin
    media.frontier = 100
    assert eng.has_ready_work()
    while eng.has_unfinished():
        eng.step()
    assert not eng.has_ready_work() and drained(eng)


class StreamingEmbeds:
    """Embedding rows for positions [2, 9) of a prompt, released a few positions per poll."""

    def __init__(self, table: torch.Tensor, prompt: list[int], step: int) -> None:
        # embeddings of other tokens (not the prompt's own): the output changes only if spliced
        self.rows_all = table[(torch.tensor(prompt) * 7 + 11) % table.shape[0]]
        self.frontier, self.step = 0, step

    def ready_until(self) -> int:
        self.frontier += self.step
        return self.frontier

    def rows(self, start, end):
        mask = torch.tensor([2 <= p < 9 for p in range(start, end)])
        return mask, self.rows_all[start:end][mask]


def test_streamed_embeddings_equal_all_at_once(model):
    prompt = ids(80, 20)
    table = model.model.embed_tokens.weight.detach()
    results = []
    for step in (100, 1, 3):  # all ready at once, then trickling in
        llm = engine(model)
        llm.engine.add_request("m", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               embeds=StreamingEmbeds(table, prompt, step))
        final = None
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                final = o if o.finished else final
        results.append(final.token_ids)
    assert results[0] == results[1] == results[2]
    plain = engine(model).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert plain.token_ids != results[0]  # the spliced rows really changed the input


def test_abort_from_another_thread_frees_pages(model):
    llm = engine(model)
    eng = llm.engine
    eng.add_request("long", ids(90, 30), SamplingParams(max_tokens=500, ignore_eos=True))
    eng.add_request("short", ids(91, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    finals = {}
    for _ in range(8):
        for o in eng.step():
            finals[o.request_id] = o
    t = threading.Thread(target=eng.abort, args=("long",))
    t.start()
    t.join()
    while eng.has_unfinished():
        for o in eng.step():
            finals[o.request_id] = o
    assert finals["long"].finish_reason == "abort" and finals["short"].finish_reason == "length"
    assert drained(eng)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [5], SamplingParams())
        eng.add_request("x", [5], SamplingParams())


def _save_word_tokenizer(model_dir) -> None:
    """A word-level tokenizer over the tiny vocab: 'w17' <-> 17 (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # no special tokens: an added "w2" would also match inside "w278"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model_dir)


def test_llm_from_model_dir_with_and_without_tokenizer(ckpt, tmp_path):
    import shutil

    kw = dict(page_size=PAGE, num_full_tokens=512, num_swa_tokens=256, max_chunk_tokens=CHUNK)
    bare = LLM(ckpt, dtype="float32", **kw)
    assert bare.tokenizer is None
    prompt = ids(100, 30)
    by_ids = bare.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate("w5 w6")

    with_tok = tmp_path / "with_tok"
    shutil.copytree(ckpt, with_tok)
    _save_word_tokenizer(with_tok)
    llm = LLM(with_tok, dtype="float32", **kw)
    text = " ".join(f"w{t}" for t in prompt)
    out = llm.generate([text], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == prompt and out.token_ids == by_ids.token_ids
    assert out.text == " ".join(f"w{t}" for t in by_ids.token_ids)
    # a stop string through the real tokenizer: cut before it, finish "stop"
    stop = f"w{by_ids.token_ids[3]}"
    cut = llm.generate([text], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and out.text.startswith(cut.text)
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(ckpt, dtype="float8")


def test_a_prefix_hit_does_not_make_a_tight_pool_refuse_what_fits_without_it(model):
    """A small SWA pool (32 tokens) fits a 60-token prompt only in smaller first chunks. With a
    20-token prefix cached, the request held its matched pages while the scheduler asked whether
    the pools were empty, so the smaller-chunk fallback was skipped and it failed "does not fit
    even alone" -- a request the same engine serves without the cache."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefix = ids(1, 20)
    answers = []
    for caching in (False, True):
        llm = engine(model, max_chunk_tokens=None, max_num_batched_tokens=64, num_swa_tokens=32,
                     enable_prefix_caching=caching)
        llm.generate([prefix], params)
        out = llm.generate([prefix + ids(2, 40)], params)[0]
        assert out.finish_reason == "length", out.error
        answers.append(out.token_ids)
    assert answers[0] == answers[1]


def test_tensor_and_numpy_prompts_are_token_ids_and_non_prompts_are_named(model):
    """A 1-D integer tensor / NumPy array or a list of NumPy integers is one token-id prompt (as a
    list of ints); a value that is no prompt is a TypeError naming it, before anything is queued."""
    import numpy as np

    llm = engine(model)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = ids(70, 9)
    ref = llm.generate([prompt], greedy)[0].token_ids
    for one in (torch.tensor(prompt), np.array(prompt), [np.int64(t) for t in prompt], tuple(prompt)):
        outs = llm.generate(one, greedy)
        assert len(outs) == 1 and outs[0].prompt_token_ids == prompt and outs[0].token_ids == ref, type(one)
    outs = llm.generate([torch.tensor(prompt), np.array(prompt, dtype=np.int32), prompt], greedy)
    assert [o.token_ids for o in outs] == [ref] * 3
    assert llm.generate([], greedy) == []
    bad = [([None], r"prompt 0 must be a string or token ids .*; got NoneType"),
           ([prompt, [5, "a"]], "prompt 1 must be .*; got list"),
           (torch.tensor([[5, 6], [7, 8]]).float(), "prompt 0 must be .*; got a 1-D Tensor of torch.float32"),
           (np.array([1.5, 2.5]), "prompt 0 must be .*; got float64"),
           (None, "prompts must be a string or token ids .*, or a list of them; got NoneType"),
           (5, "got int")]
    for prompts, message in bad:
        with pytest.raises(TypeError, match=message):
            llm.generate(prompts, greedy)
    assert not llm.engine.has_unfinished()
