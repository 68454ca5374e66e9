"""A non-streamed answer with several choices stops them all as soon as one fails (choices.py)."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import pytest

from mm_pipeline.errors import InternalError, generation_error
from mm_pipeline.runtime.omni_engine import GenerationDelta
from mm_pipeline.server.completions.choices import ChoiceStream, collect_all, start_all


class _Generations:
    """Engine generators of 1000 tokens, 1 ms apart; ``open`` counts those not yet closed. Choice 0
    fails after 3 tokens: ``how`` "raise" (an exception) or "error" (a final delta with an error)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.open = 0

    async def gen(self, index: int) -> AsyncIterator[GenerationDelta]:
        self.open += 1
        rid = f"r-{index}"
        try:
            for i in range(1000):
                await asyncio.sleep(0.001)
                if index == 0 and i == 3:
                    if self.how == "raise":
                        raise RuntimeError("engine bug")
                    yield GenerationDelta(rid, [], "", None, None, True, "error", 3, i, 0, time.time(),
                                          error="boom", error_kind="internal")
                    return
                yield GenerationDelta(rid, [7], "x", None, None, i == 999, "length" if i == 999 else None,
                                      3, i + 1, 0, time.time())
        finally:
            self.open -= 1


@pytest.mark.parametrize("how", ["raise", "error"])
def test_one_failed_choice_stops_its_siblings(how):
    """Before, gather() kept the other choices generating to max_tokens (holding their slots) and
    close() could not aclose() generators their tasks still iterated."""
    async def main():
        engine = _Generations(how)
        choices = [ChoiceStream(i, engine.gen(i)) for i in range(4)]
        await start_all(choices)
        t0 = time.monotonic()
        if how == "raise":
            with pytest.raises(RuntimeError, match="engine bug"):
                await collect_all(choices)
        else:
            states = await collect_all(choices)
            assert isinstance(generation_error(states[0].finish_reason, states[0].error_kind, states[0].error),
                              InternalError)
            assert all(s.finish_reason is None for s in states[1:])  # stopped, not run to the end
        assert engine.open == 0 and time.monotonic() - t0 < 0.5  # 1000 tokens would take >= 1 s
    asyncio.run(main())


def test_choices_that_all_finish_are_collected_in_order():
    async def main():
        engine = _Generations("none")
        choices = [ChoiceStream(i, engine.gen(i + 1)) for i in range(3)]
        await start_all(choices)
        states = await collect_all(choices)
        assert [len(s.token_ids) for s in states] == [1000] * 3 and engine.open == 0
        assert all(s.finish_reason == "length" for s in states)
    asyncio.run(main())
