"""KV pool sizes an engine builds from its EngineConfig (llm_core/engine/engine_config.py pool_sizing):
a byte budget, the CPU default, and SWA sized by its formula rather than copied from Full."""

from __future__ import annotations

from dataclasses import replace

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.kvcache.dual_pool import swa_tokens_needed
from tests.llm_core.engine.test_llm_generate import CHUNK, PAGE, WINDOW, ckpt, ids, model  # noqa: F401 (fixtures)


def test_pool_sizes_from_a_byte_budget(model):
    budget = 64 << 20
    eng = LLMEngine(model, EngineConfig(page_size=PAGE, kv_cache_bytes=budget, max_num_seqs=4, max_chunk_tokens=CHUNK))

    assert eng.pool.full.num_pages > 0 and eng.pool.swa.num_pages * PAGE >= 4 * (WINDOW + CHUNK)
    assert eng.pool.total_bytes <= budget
    assert eng.pool.total_bytes >= budget * 0.9  # the budget is used, not ignored
    out = LLM.from_engine(eng).generate([ids(101, 20)], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length"


def test_default_pools_fit_the_model_and_swa_follows_the_formula(model):
    """No sizes given: on CPU the fixed default space, but never more Full KV than max_num_seqs
    requests of max_model_len can use; SWA what the running requests and the reserve need."""
    cfg = EngineConfig(page_size=PAGE, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
                       swa_release_interval=2, swa_checkpoint_reserve_windows=3)
    eng = LLMEngine(model, cfg)
    need = swa_tokens_needed(eng.pool.layout, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16,
                             swa_release_interval=2, checkpoint_reserve_windows=3)
    assert need == 4 * (WINDOW + 2 + 2 * PAGE) + 16 + 3 * (WINDOW + PAGE)
    assert (eng.pool.full.num_pages * PAGE, eng.pool.swa.num_pages * PAGE) == (4 * 64, need)
    off = LLMEngine(model, replace(cfg, enable_prefix_caching=False))  # no cache: no checkpoint reserve
    assert off.pool.swa.num_pages * PAGE == need - 3 * (WINDOW + PAGE)


def test_explicit_full_size_sizes_swa_by_the_formula_not_as_a_copy(model):
    eng = LLMEngine(model, EngineConfig(page_size=PAGE, num_full_tokens=4096, max_num_seqs=2))
    assert eng.pool.full.num_pages * PAGE == 4096
    assert 0 < eng.pool.swa.num_pages * PAGE < 4096
    both = LLMEngine(model, EngineConfig(page_size=PAGE, num_full_tokens=4096, num_swa_tokens=64))
    assert (both.pool.full.num_pages * PAGE, both.pool.swa.num_pages * PAGE) == (4096, 64)
