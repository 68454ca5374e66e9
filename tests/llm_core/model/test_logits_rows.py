"""``ForwardBatch.logits_only``: the last layer runs its attention, MLP and final norm for the logits
rows alone, yet those rows' logits equal transformers', every row's K/V still reaches the pool (the
next steps read it), and a chunk that samples nothing computes no output row at all."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.model.loader import load_model
from tests.llm_core.model.test_model_equivalence import TOL, Runner, hf_logits, prompt
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")


class RowsRunner(Runner):
    """Runner whose steps ask for the logits of each request's last new token only (or none)."""

    def step_rows(self, work, samples: list[bool], logits_only: bool):
        captured = {}
        model_call = self.model.forward

        def forward(ids, batch, kv, inputs_embeds=None):
            qsl = batch.query_start_loc.tolist()
            rows = torch.tensor([qsl[b + 1] - 1 for b in range(len(work)) if samples[b]], dtype=torch.long)
            batch = dataclasses.replace(batch, logits_indices=rows, logits_only=logits_only)
            hidden = model_call(ids, batch, kv, inputs_embeds=inputs_embeds)
            captured["rows"] = batch.logits_hidden(hidden)
            return hidden

        self.model.forward = forward
        try:
            self.step(work)
        finally:
            del self.model.forward
        with torch.no_grad():
            return self.model.compute_logits(captured["rows"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_dir = build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")
    ids = {r: prompt(10 + r, 29) for r in range(3)}
    return load_model(hf_dir, dtype=torch.float32), {r: hf_logits(hf_dir, ids[r]) for r in ids}, ids


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=4, max_size=4), st.integers(0, 1000))
def test_logits_rows_match_hf_and_the_kv_reaches_the_pool(tiny, plan, seed):
    """Three requests step through their prompts together in chunks of random sizes, each step
    sampling a random subset; the sampled rows' logits match HF, and the last step (every request's
    remaining tokens, all sampled) still matches, so the K/V the cut layer stored was right."""
    model, ref, ids = tiny
    runner = RowsRunner(model, seed=seed)
    done = {r: 0 for r in ids}
    for n, sample_all in plan + [(29, True)]:
        work, samples = [], []
        for r in ids:
            take = min(n + r, 29 - done[r])
            if take:
                work.append((r, ids[r][done[r] : done[r] + take]))
                samples.append(sample_all or r == 0)
        if not work:
            continue
        got = runner.step_rows(work, samples, logits_only=True)
        rows = [(r, done[r] + len(chunk) - 1) for (r, chunk), s in zip(work, samples) if s]
        assert got.shape[0] == len(rows)
        for i, (r, pos) in enumerate(rows):
            torch.testing.assert_close(got[i], ref[r][pos], atol=TOL, rtol=TOL)
        for r, chunk in work:
            done[r] += len(chunk)
    assert all(d == 29 for d in done.values())


def test_a_chunk_that_samples_nothing_returns_no_rows(tiny):
    model, ref, ids = tiny
    runner = RowsRunner(model)
    assert runner.step_rows([(0, ids[0][:20])], [False], logits_only=True).shape[0] == 0
    got = runner.step_rows([(0, ids[0][20:])], [True], logits_only=True)
    torch.testing.assert_close(got[0], ref[0][28], atol=TOL, rtol=TOL)
