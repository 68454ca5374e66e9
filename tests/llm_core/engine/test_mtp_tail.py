"""The MTP proposer keeps one row of hidden states per request between steps (its *tail*). That
row must be a copy: a view would keep the whole step's [T, H] tensors alive, a prefill step's for
as long as an idle request (which commits no newer tail) runs."""

from __future__ import annotations

import pytest

from llm_core import SamplingParams
from tests.llm_core.engine.test_speculative import engine, ids, model  # noqa: F401 -- fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["first", "chain"])
def test_tails_hold_only_their_own_rows(model, mode):
    eng = engine(model, speculative_tokens=2, speculative_layers=mode, max_chunk_tokens=None)
    for i in range(3):
        eng.add_request(f"r{i}", ids(400 + i, 30), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    seen = 0
    while eng.has_unfinished():
        eng.step()
        for tail in list(eng.speculative.proposer._tails.values()):
            levels = list(tail.levels)
            size = sum(lv.numel() * lv.element_size() for lv in levels)
            held = [lv.untyped_storage().nbytes() for lv in levels]
            assert held == [size] * len(levels)  # its own rows, not the step's [T, H] tensor
            seen += 1
    assert seen
