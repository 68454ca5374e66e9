"""cache_salt (vLLM's per-request field) on the tiny MiMo-V2 model: a request shares prefix-cache KV
only with requests of the same salt -- in L1, and in the L3 directory tier across a restart -- and
its greedy tokens are those of an unsalted run."""

from __future__ import annotations

import pytest
import torch

from llm_core import LLM, EngineConfig, ErrorKind, LLMEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(11)).tolist()


def make(model, **kw) -> LLM:
    cfg = dict(page_size=4, max_chunk_tokens=7, max_num_batched_tokens=24, num_full_tokens=1024, num_swa_tokens=256,
               enable_prefix_caching=True, prefix_checkpoint_every=8)
    return LLM.from_engine(LLMEngine(model, EngineConfig(**{**cfg, **kw})))


def ask(llm: LLM, salt: str | None) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], GREEDY, cache_salt=salt)[0]
    return out.token_ids, out.num_cached_tokens


def test_only_requests_of_the_same_salt_share_kv(model):
    llm = make(model)
    first, cached = ask(llm, "tenant-a")
    assert cached == 0
    runs = {salt: ask(llm, salt) for salt in ("tenant-b", None, "tenant-a")}
    assert runs["tenant-b"][1] == 0 and runs[None][1] == 0  # other salts and none miss...
    assert runs["tenant-a"][1] == 36  # ...the same salt hits all but the last page's token
    assert ask(llm, None)[1] == 36  # unsalted requests share among themselves, as before
    assert all(tokens == first for tokens, _ in runs.values())


def test_a_salted_prefix_survives_a_restart_in_l3_only_under_its_salt(model, tmp_path):
    store = str(tmp_path / "l3")
    first = make(model, kv_store=store, kv_host_bytes=0)
    tokens, _ = ask(first, "tenant-a")
    first.engine.close()  # the tree is written down
    again = make(model, kv_store=store, kv_host_bytes=0, kv_l3_load_timeout_s=30.0)
    assert ask(again, "tenant-b") == (tokens, 0)
    assert ask(again, None) == (tokens, 0)
    hit_tokens, hit = ask(again, "tenant-a")
    assert hit_tokens == tokens and hit > 0
    assert again.engine.stats().prefix_cache_hit_tokens["l3"] > 0
    again.engine.close()


def test_bad_salts_are_refused(model):
    llm = make(model)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([PROMPT], GREEDY, cache_salt="")
    eng = llm.engine
    eng.add_request("long", PROMPT, GREEDY, cache_salt="x" * 5000)
    eng.add_request("number", PROMPT, GREEDY, cache_salt=12)
    outs = {o.request_id: o for o in eng.step()}
    assert {r: (o.finish_reason, o.error_kind) for r, o in outs.items()} == {
        "long": ("error", ErrorKind.INVALID_INPUT), "number": ("error", ErrorKind.INVALID_INPUT)}
    assert "cache_salt" in outs["long"].error and not eng.has_unfinished()
