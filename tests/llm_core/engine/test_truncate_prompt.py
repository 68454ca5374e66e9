"""vLLM's truncate_prompt_tokens: a prompt cut to its last k tokens (-1: what the context holds with
room for one more) runs exactly as those tokens given alone; checkpoints move with the cut; a
prompt with embedding rows (media) is never cut but fails alone; bad values are refused."""

from __future__ import annotations

import pytest
import torch

from llm_core import EngineConfig, LLMEngine, SamplingParams
from tests.llm_core.engine.test_llm_generate import ckpt, ids, model  # noqa: F401 -- fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def make_engine(model, **kw) -> LLMEngine:
    cfg = dict(page_size=4, max_chunk_tokens=8, max_num_batched_tokens=32, num_full_tokens=2048, num_swa_tokens=512)
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def finish(eng: LLMEngine, rid: str):
    for _ in range(500):
        for o in eng.step():
            if o.finished and o.request_id == rid:
                return o
    raise AssertionError("did not finish")


class Rows:
    """An EmbeddingSource whose rows are ready: positions [1, 3) take fixed rows."""

    def __init__(self, n: int, hidden: int) -> None:
        self.n, self.values = n, torch.randn(2, hidden, generator=torch.Generator().manual_seed(3))

    def ready_until(self) -> int:
        return self.n

    def rows(self, start: int, end: int):
        mask = torch.tensor([1 <= p < 3 for p in range(start, end)])
        return mask, self.values[[p - 1 for p in range(start, end) if 1 <= p < 3]]


def test_a_cut_prompt_runs_as_its_last_tokens_alone(model):
    p = ids(5, 30)
    eng = make_engine(model)
    eng.add_request("cut", p, SamplingParams(truncate_prompt_tokens=11, **GREEDY))
    cut = finish(eng, "cut")
    eng.add_request("alone", p[-11:], SamplingParams(**GREEDY))
    alone = finish(eng, "alone")
    assert cut.prompt_token_ids == p[-11:] and cut.token_ids == alone.token_ids
    eng.add_request("short", p[:5], SamplingParams(truncate_prompt_tokens=11, **GREEDY))  # shorter: untouched
    assert finish(eng, "short").prompt_token_ids == p[:5]


def test_minus_one_keeps_what_the_context_holds(model):
    eng = make_engine(model, num_full_tokens=64, num_swa_tokens=64, max_model_len=40)
    p = ids(6, 100)
    eng.add_request("over", p, SamplingParams(**GREEDY))
    assert finish(eng, "over").error_kind == "context_length"  # without truncation: refused
    eng.add_request("cut", p, SamplingParams(truncate_prompt_tokens=-1, **GREEDY))
    out = finish(eng, "cut")
    assert out.prompt_token_ids == p[-(eng.max_context_tokens - 1):] and out.finish_reason == "length"
    assert len(out.token_ids) == 1  # the one token of room the cut leaves


def test_checkpoints_move_with_the_cut(model):
    from llm_core.engine.request import truncate_prompt

    ids_, keys, points = truncate_prompt(list(range(3, 23)), 8, False, (), (4, 12, 16, 20))
    assert ids_ == list(range(15, 23)) and points == (4, 8) and keys == ()


def test_media_is_never_cut(model):
    eng = make_engine(model)
    hidden = eng.model_config.hidden_size
    p = [7, 0, 0] + ids(8, 20)
    eng.add_request("media", p, SamplingParams(truncate_prompt_tokens=10, **GREEDY), embeds=Rows(len(p), hidden))
    out = finish(eng, "media")
    assert out.finish_reason == "error" and out.error_kind == "invalid_input" and "holds media" in out.error
    eng.add_request("fits", p, SamplingParams(truncate_prompt_tokens=50, **GREEDY), embeds=Rows(len(p), hidden))
    assert finish(eng, "fits").finish_reason == "length"
    eng.prefix_cache.clear()
    assert eng.pool.all_free()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)
