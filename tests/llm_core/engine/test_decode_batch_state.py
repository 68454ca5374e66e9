"""The persistent decode batch (llm_core/engine/decode_batch_state.py): over random join / finish /
abort / preemption sequences, with page-boundary crossings and SWA pages released behind the window,
every step's ForwardBatch equals the rebuild tensor for tensor, and the engine gives the same tokens
and bit-identical logprobs with it on and off; the switch is reachable from EngineConfig and the CLI."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_core import EngineConfig, LLMEngine, SamplingParams
from llm_core.engine import decode_batch_state
from llm_core.engine.batch_builder import build_forward_batch
from llm_core.engine.request import Request
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.model.loader import load_model
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

PAGE = 4
FIELDS = ("positions", "query_start_loc", "seq_lens", "full_slot_mapping", "swa_slot_mapping",
          "full_block_table", "swa_block_table", "logits_indices")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf"), dtype=torch.float32)


@pytest.fixture
def checked(monkeypatch):
    """Every build of the state is compared with build_forward_batch of the same entries."""
    original = decode_batch_state.DecodeBatchState.build

    def build(self, entries, device, step, logits_only=False):
        fb, ids = original(self, entries, device, step, logits_only)
        ref, ref_ids = build_forward_batch(entries, self.page_size, device, logits_only=logits_only)
        assert torch.equal(ids, ref_ids)
        for name in FIELDS:
            a, b = getattr(fb, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert (fb.logits_only, fb.logits_every_row, fb.slots_all_valid) == \
               (ref.logits_only, ref.logits_every_row, ref.slots_all_valid)
        assert not fb.step_cache  # a fresh memo: plans are derived from this step's fields
        return fb, ids

    monkeypatch.setattr(decode_batch_state.DecodeBatchState, "build", build)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4)), min_size=1, max_size=60), st.booleans(),
       st.integers(1, 5))
def test_state_alone_over_random_steps(checked, events, has_swa, page):
    """The state without an engine: requests join (0), leave (1), get preempted (2: new page lists,
    absent a step), have SWA pages released (3) or just decode (4); no SWA pool: every SWA page -1."""
    live: list[Request] = []
    serial, next_page = 0, 1
    state = decode_batch_state.DecodeBatchState(page)
    for step, (pick, kind) in enumerate(events, start=1):
        skip = False
        if kind == 0 or not live:
            serial += 1
            live.insert(pick % (len(live) + 1), Request(f"r{serial}", list(range(pick + 1)), SamplingParams(), 0))
        elif kind == 1:
            live.pop(pick % len(live))
        elif kind == 2:
            req = live[pick % len(live)]
            req.full_pages, req.swa_pages, req.swa_released_pages = [], [], 0
            skip = True  # its prompt is recomputed in a step of its own
        elif kind == 3:
            req = live[pick % len(live)]
            upto = min(len(req.swa_pages) - 1, req.swa_released_pages + 1)
            if has_swa and upto > req.swa_released_pages:
                req.swa_pages[req.swa_released_pages:upto] = [-1] * (upto - req.swa_released_pages)
                req.swa_released_pages = upto
        for req in live:
            req.token_ids.append(step % 7)
            while len(req.full_pages) * page < len(req.token_ids):
                req.full_pages.append(next_page)
                req.swa_pages.append(next_page + 5000 if has_swa else -1)
                next_page += 1
        entries = [ScheduledRequest(r, len(r.token_ids) - 1, 1) for r in live]
        if skip or not entries:
            continue  # a step without decodes does not reach the runner's input preparation
        # the caller's logits_only flag changes between steps (as a runner whose every_row_hidden
        # were toggled would pass it): an advance must still equal the rebuild with this step's flag
        state.build(entries, torch.device("cpu"), step, logits_only=bool(pick % 2))  # ``checked``: == rebuild
    assert state.advanced + state.rebuilt > 0


def run(model, schedule, *, on: bool, **kw) -> tuple[dict, LLMEngine]:
    """Drive an engine step by step: ``schedule`` is a list of (step, kind, arg) events."""
    cfg = dict(page_size=PAGE, max_chunk_tokens=6, max_num_batched_tokens=24, num_full_tokens=2048,
               num_swa_tokens=512, swa_release_interval=1, compile_decode=False, enable_prefix_caching=False)
    eng = LLMEngine(model, EngineConfig(**{**cfg, **kw, "persistent_decode_batch": on}))
    out: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    pending = sorted(schedule, key=lambda ev: ev[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, kind, arg = pending.pop(0)
            if kind == "add":
                rid, prompt, n, lp = arg
                eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                            logprobs=1 if lp else None))
            else:
                eng.abort(arg)
        for o in eng.step():
            out[o.request_id] = (list(o.token_ids), list(o.logprobs or []))
        step += 1
        assert step < 2000
    return out, eng


@st.composite
def schedules(draw):
    events = []
    for i in range(draw(st.integers(1, 7))):
        at = draw(st.integers(0, 30))
        prompt = draw(st.lists(st.integers(3, 500), min_size=1, max_size=30))
        events.append((at, "add", (f"r{i}", prompt, draw(st.integers(1, 30)), draw(st.booleans()))))
        if draw(st.integers(0, 4)) == 0:
            events.append((at + draw(st.integers(1, 20)), "abort", f"r{i}"))
    return events


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules(), st.sampled_from([2048, 120]))
def test_random_joins_finishes_aborts_and_preemption_match_the_rebuild(model, checked, schedule, full_tokens):
    """120 Full tokens: requests preempt each other and come back with new page lists."""
    off, _ = run(model, schedule, on=False, num_full_tokens=full_tokens, num_swa_tokens=min(full_tokens, 512))
    on, eng = run(model, schedule, on=True, num_full_tokens=full_tokens, num_swa_tokens=min(full_tokens, 512))
    assert on == off  # tokens and logprobs, exactly
    assert eng.runner.decode_state.rebuilt > 0


def test_long_decode_advances_across_pages_and_swa_releases(model, checked, monkeypatch):
    """Three requests of different lengths decode 40 tokens together: most steps advance, rows that
    start a page or lose SWA pages behind the window (8) are rewritten alone."""
    schedule = [(0, "add", (f"r{i}", list(range(5 + i, 12 + 2 * i)), 40, True)) for i in range(3)]
    off, _ = run(model, schedule, on=False)
    released = []
    advance = decode_batch_state.DecodeBatchState._advance

    def watch(self, entries, device, step):
        released.extend(e.request.swa_released_pages for e in entries if e.request.swa_released_pages)
        return advance(self, entries, device, step)

    monkeypatch.setattr(decode_batch_state.DecodeBatchState, "_advance", watch)
    on, eng = run(model, schedule, on=True)
    assert on == off
    state = eng.runner.decode_state
    assert state.advanced > state.rebuilt > 3
    assert state.rows_rewritten > 0  # rows that started a page or had SWA pages released, patched alone
    assert released  # SWA pages were released behind the window while the rows advanced


def test_switch_from_config_and_cli(model):
    assert EngineConfig().persistent_decode_batch is True
    assert LLMEngine(model, EngineConfig(persistent_decode_batch=False, num_full_tokens=256,
                                         num_swa_tokens=128)).runner.decode_state is None
    from mm_pipeline.cli import build_parser
    from mm_pipeline.config_flags import config_flags, config_values
    from mm_pipeline.runtime.config import OmniEngineConfig

    args = build_parser().parse_args(["serve", "--model", "m", "--no-persistent-decode-batch"])
    assert OmniEngineConfig.from_kwargs(**config_values(args, config_flags())).engine.persistent_decode_batch is False
