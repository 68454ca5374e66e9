"""Priority scheduling through the engine on the tiny MiMo-V2 model: greedy tokens do not depend on
the order requests are served in (mixed priorities with preemptions == fcfs == each alone), the most
urgent request finishes first, and a priority the engine would ignore is refused, never dropped."""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, ErrorKind, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


def engine(model, **kw) -> LLM:
    cfg = dict(page_size=4, max_chunk_tokens=5, max_num_batched_tokens=16, num_full_tokens=2048, num_swa_tokens=512)
    return LLM.from_engine(LLMEngine(model, EngineConfig(**{**cfg, **kw})))


def test_mixed_priorities_with_preemptions_give_the_fcfs_tokens(model):
    prompts = [ids(70 + i, 18 + 5 * i) for i in range(6)]
    ranks = [3, -1, 0, 7, -1, 2]
    fcfs = engine(model).generate(prompts, GREEDY)
    tight = engine(model, queue_policy="priority", num_full_tokens=96, num_swa_tokens=64)
    outs = tight.generate(prompts, GREEDY, priority=ranks)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in fcfs]
    tight.engine.prefix_cache.clear()
    assert tight.engine.pool.all_free()


def test_the_most_urgent_request_finishes_first(model):
    llm = engine(model, queue_policy="priority", max_num_seqs=1)
    eng = llm.engine
    for k, rank in enumerate([5, 1, 3]):
        eng.add_request(f"r{k}", ids(90 + k, 9), GREEDY, priority=rank)
    done = []
    while eng.has_unfinished():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["r1", "r2", "r0"]


def test_a_priority_without_priority_scheduling_is_refused(model):
    llm = engine(model)  # fcfs
    with pytest.raises(ValueError, match="priority scheduling is off.*--queue-policy priority"):
        llm.generate([ids(1, 6)], GREEDY, priority=[2])
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate([ids(1, 6), ids(2, 6)], GREEDY, priority=[0])
    assert llm.generate([ids(1, 6)], GREEDY, priority=[0])[0].finish_reason == "length"  # 0 is fine
    eng = llm.engine
    eng.add_request("bad", ids(3, 6), GREEDY, priority=4)
    eng.add_request("wrong-type", ids(3, 6), GREEDY, priority=True)
    eng.add_request("huge", ids(3, 6), GREEDY, priority=2**63)
    outs = {o.request_id: o for o in eng.step()}
    assert all(outs[r].finish_reason == "error" and outs[r].error_kind is ErrorKind.INVALID_INPUT
               for r in ("bad", "wrong-type", "huge"))
    assert "priority scheduling is off" in outs["bad"].error and "[-2**63, 2**63)" in outs["huge"].error
    assert not eng.has_unfinished()
    prio = engine(model, queue_policy="priority").engine
    assert prio.check_priority(-(2**63)) is None and prio.check_priority(2**63) is not None
