"""SpeculativeRunner: one engine step with MTP drafts, in place of ModelRunner.run.

    entries (a decoding entry carries num_draft_tokens = k, its pages allocated for 1 + k tokens)
      -> MTPProposer.draft: k greedy tokens appended to request.token_ids
      -> one target forward over every entry's rows (prefill chunks, plain decodes, 1 + k verify rows)
      -> MTPProposer.extend: the MTP layers' KV for the same rows
      -> drafts removed from token_ids again (always, even when the step raises)
      -> sampling: ModelRunner's sampler for plain rows; verify.py for verify rows
      -> StepResult whose ``sampled`` holds 1..k+1 SampledTokens per verify entry, in order

The engine then appends the tokens with its stop checks and tells the scheduler how many positions
each verify entry really computed (``Scheduler.after_step(batch, computed_ends)``), which rolls the
rest back in both pools. Nothing of a rejected token reaches the prefix cache: the cache only ever
sees positions below ``num_computed_tokens``.
"""

from __future__ import annotations

import time

import torch

from llm_core.engine.batch_builder import build_forward_batch, splice_embeds
from llm_core.engine.model_runner import ModelRunner, SampledToken, StepResult
from llm_core.engine.sampling.prompt_logprobs import compute_prompt_logprobs, wanted_rows
from llm_core.engine.sampling import Sampler
from llm_core.engine.scheduled_batch import ScheduledRequest
from llm_core.engine.speculative.adaptive import DraftLength
from llm_core.engine.speculative.proposer import MTPProposer
from llm_core.engine.speculative.stats import SpecStats
from llm_core.engine.speculative.verify import verify_greedy, verify_sampled
from llm_core.kvcache.dual_pool import KVLayout
from llm_core.model.mtp import mtp_head_of, mtp_kv_layout

DEFAULT_DRAFT_TOKENS = 3  # MiMo-V2.5 ships 3 MTP layers; the demo head is trained for 3 steps


class SpeculativeRunner:
    """Wraps the engine's ModelRunner (its model and sampler); same ``run`` / ``forward`` contract."""

    def __init__(self, runner: ModelRunner, proposer: MTPProposer, draft_length: DraftLength) -> None:
        self.runner, self.proposer, self.draft_length = runner, proposer, draft_length
        self.model = runner.model
        self.stats = SpecStats(proposer.max_draft)

    # ---- what the engine and the scheduler ask ---------------------------------------------------
    def kv_layout(self, layout: KVLayout) -> KVLayout:
        """The target's layout plus one sliding layer per MTP layer that keeps KV (SWA pool)."""
        return mtp_kv_layout(layout, self.proposer.num_layers, self.model.config.sliding_window)

    def num_draft_tokens(self, request, num_running: int, max_model_len: int) -> int:
        """k for a decoding request this step (the scheduler caps it by budget and pages). A request
        whose logits are processed (logit_bias, min_tokens, penalties: ``SamplingParams.processes_logits``)
        never drafts: its tokens come from plain rows, which see its tokens so far, so speculation
        stays exact without re-deriving the penalties for each drafted position (min_p is part of the
        verified distribution, ``Sampler.probs``, and drafts as usual)."""
        if request.params.processes_logits:
            return 0
        k = self.draft_length.choose(request, num_running)
        room = min(max_model_len - request.num_tokens, request.params.max_tokens - request.num_output_tokens - 1)
        return max(0, min(k, self.proposer.max_draft, room))

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, entries: list[ScheduledRequest], kv) -> torch.Tensor:
        """Drafts, target and MTP forward of ``entries`` without sampling (the engine's fault probe)."""
        return self._forward(entries, kv, self._idle(entries))[0]

    @torch.inference_mode()
    def run(self, entries: list[ScheduledRequest], kv) -> StepResult:
        started = time.thread_time()
        hook = self.runner.before_step  # the owner's per-step settings (intra-op threads), as a plain step has them
        if hook is None:
            return self._step(entries, kv, started)
        hook(sum(e.num_new_tokens for e in entries))
        self.runner.before_step = None  # asked once per step: not again by the plain step inside
        try:
            return self._step(entries, kv, started)
        finally:
            self.runner.before_step = hook

    def _step(self, entries: list[ScheduledRequest], kv, started: float) -> StepResult:
        self.draft_length.steps += 1
        idle = self._idle(entries)
        if entries and len(idle) == len(entries):
            # nothing drafts and no MTP work is due (every entry an idle decode): a plain step, at
            # exactly plain decoding's cost (the idle requests' tails are not kept: see _forward)
            result = self.runner.run(entries, kv)
        else:
            result = self._run(entries, kv, idle)
        # what this step cost feeds the step gate (adaptive.py, step_cost.py): decode-only steps
        # only, a prefill chunk would dominate the time
        if all(e.start >= e.request.num_prompt_tokens for e in entries):
            self.draft_length.cost.record(len(entries), max((e.num_draft_tokens for e in entries), default=0),
                                          time.thread_time() - started)
        self.draft_length.plan([e.request for e in entries])
        return result

    def _run(self, entries: list[ScheduledRequest], kv, idle: set[int]) -> StepResult:
        logits, drafts, rows_of, commit, prompt = self._forward(entries, kv, idle)
        sampled: list[SampledToken] = []
        failed: list[tuple[ScheduledRequest, Exception]] = []
        plain = [e for e in entries if e.samples and not e.num_draft_tokens]
        if plain:
            out, bad = self.runner.sampler.sample_isolated(
                _rows_on(logits, [rows_of[id(e)][-1] for e in plain]), [e.request.params for e in plain], [e.request.generator for e in plain],
                [e.request for e in plain])
            for i, e in enumerate(plain):
                if i in bad:
                    failed.append((e, bad[i]))
                else:
                    sampled.append(SampledToken(e, out.token_ids[i], out.logprobs[i], out.top_logprobs[i]))
        try:
            targets = _greedy_targets(entries, logits, rows_of)
        except Exception:  # noqa: BLE001 -- then each greedy request reads its own rows, failing alone
            targets = {}
        for e in entries:
            if not e.num_draft_tokens:
                continue
            try:
                tokens = self._verify(e, logits, rows_of[id(e)], drafts[id(e)], targets.get(id(e)))
                commit(e, len(tokens) - 1)
                sampled.extend(tokens)
            except Exception as exc:  # noqa: BLE001 -- ends this request only
                failed.append((e, exc))
        return StepResult(sampled, failed, prompt)

    def _verify(self, e: ScheduledRequest, logits: torch.Tensor, rows: list[int], drafts: list[int],
                target: list[int] | None) -> list[SampledToken]:
        """The tokens request ``e`` emits from its verify ``rows`` of ``logits``; ``target``: their
        argmax, read already for a greedy request (``_greedy_targets``)."""
        req, p = e.request, e.request.params
        own = None  # this request's rows, gathered only when something reads them
        if p.greedy:
            if target is None:  # the step's shared read failed (_run): this request's rows alone
                own = _rows_on(logits, rows)
                target = own.argmax(dim=-1).tolist()
            tokens = verify_greedy(target, drafts)
        else:
            own = _rows_on(logits, rows)
            tokens = verify_sampled(own, drafts, p, req.generator, self.runner.sampler)
        accepted = len(tokens) - 1
        self.stats.record(len(drafts), accepted)
        self.draft_length.update(req, len(drafts), accepted)
        if p.logprobs is not None and own is None:
            own = _rows_on(logits, rows)
        # without logprobs _logprobs reads no logits: the whole step's stand in, untouched
        lp = Sampler._logprobs((logits if own is None else own)[: len(tokens)], tokens, [p] * len(tokens))
        return [SampledToken(e, t, lp.logprobs[i], lp.top_logprobs[i]) for i, t in enumerate(tokens)]

    def _idle(self, entries: list[ScheduledRequest]) -> set[int]:
        """``id``s of the plain decodes whose requests the adaptive length has idle (adaptive.py)."""
        return {id(e) for e in entries if e.num_new_tokens == 1 and e.start >= e.request.num_prompt_tokens
                and self.draft_length.idle(e.request, len(entries))}

    def _forward(self, entries: list[ScheduledRequest], kv, idle: set[int]):
        model, proposer = self.model, self.proposer
        spec = [e for e in entries if e.num_draft_tokens]
        lengths = {id(e): len(e.request.token_ids) for e in spec}
        graphs = self.runner.decode_graphs
        # across ranks the verify rows are not mirrored as graph rows: such steps run eagerly there
        fixed = graphs is not None and not proposer.mirrored and graphs.supports_rows(entries)
        every_logit = None
        try:
            proposer.draft(spec, kv)
            drafts = {id(e): e.request.token_ids[e.start + 1:e.end] for e in spec}
            fb, ids = build_forward_batch(entries, self.runner.page_size, self.runner.device)
            embeds = splice_embeds(entries, ids, model.embed)
            if embeds is None:
                # the MTP extend's input. A step of decodes and verifies holds sampled and drafted
                # (argmax) ids only, always in the vocabulary: no checked embed, whose host read of
                # the ids' range would synchronize the stream once per step
                embeds = model.model.embed_tokens(ids) if fixed else model.embed(ids)
            if fixed:  # decodes and verifies only: each token a row of the bucket's graph (VerifyRows)
                every_logit, hidden = graphs.forward_rows(entries, kv)
            else:
                hidden = model(None, fb, kv, inputs_embeds=embeds)
            outs = proposer.extend(entries, fb, embeds, hidden, kv, skip=idle)
        finally:
            for e in spec:
                del e.request.token_ids[lengths[id(e)]:]
        qsl = fb.query_start_loc.tolist()
        rows_of: dict[int, list[int]] = {}
        flat: list[int] = []
        for b, e in enumerate(entries):
            if e.num_draft_tokens:
                rows_of[id(e)] = list(range(len(flat), len(flat) + qsl[b + 1] - qsl[b]))
                flat.extend(range(qsl[b], qsl[b + 1]))
            elif e.samples:
                rows_of[id(e)] = [len(flat)]
                flat.append(qsl[b + 1] - 1)
        # a fixed-shape step's logits are the graph's buffer: gathered here, before any other replay
        if every_logit is not None:
            logits = every_logit[torch.tensor(flat, dtype=torch.long).to(hidden.device, non_blocking=True)]
        elif proposer.mirrored:  # every rank takes the same rows of its own hidden states
            logits = model.compute_logits_at(hidden, flat)
        else:
            logits = model.compute_logits(hidden[torch.tensor(flat, dtype=torch.long).to(hidden.device, non_blocking=True)])
        first_row = {id(e): qsl[b] for b, e in enumerate(entries)}
        # every row's hidden state is here (the MTP layer reads them all): prompt logprobs come free
        wanted = wanted_rows(entries, qsl)
        found = compute_prompt_logprobs(lambda a, b: model.compute_logits_rows(hidden, a, b), wanted) if wanted else {}
        prompt = [(e, found[id(e)]) for e, *_ in wanted]

        def commit(e: ScheduledRequest, accepted: int) -> None:
            """Keep the request's tail: the hidden states of its last row that counts as computed."""
            row = first_row[id(e)] + accepted
            proposer.commit(e.request, e.start + accepted, row, hidden, outs)

        for e in entries:
            # an idle request keeps no tail (one index op each, ~2 % of a batch-32 step): its MTP KV
            # misses these positions anyway, and a tail of a stale position reads as zeros
            if not e.num_draft_tokens and id(e) not in idle:
                commit(e, e.num_new_tokens - 1)
        return logits, drafts, rows_of, commit, prompt


def build_speculative(model: torch.nn.Module, runner: ModelRunner, *, tokens: int | None, mode: str,
                      adaptive: bool) -> SpeculativeRunner | None:
    """The engine's speculative runner, or None: ``tokens`` 0, or no MTP layers in the checkpoint
    (``tokens`` None = DEFAULT_DRAFT_TOKENS when there are)."""
    head = mtp_head_of(model)
    if tokens == 0 or head is None:
        if tokens and head is None:
            raise ValueError(f"speculative_tokens={tokens} needs MTP layers (model.mtp.layers.*) in the checkpoint")
        return None
    k = DEFAULT_DRAFT_TOKENS if tokens is None else tokens
    proposer = MTPProposer(model, head, mode=mode, max_draft=k, page_size=runner.page_size)
    return SpeculativeRunner(runner, proposer, DraftLength(proposer.max_draft, adaptive=adaptive))


def _rows_on(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, the index sent to the logits' device without a blocking copy (a plain
    ``torch.tensor(rows, device=...)`` synchronizes the stream)."""
    return logits[torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)]


def _greedy_targets(entries: list[ScheduledRequest], logits: torch.Tensor, rows_of: dict) -> dict[int, list[int]]:
    """The argmax of every verify row of the step's greedy drafting requests, by ``id(entry)``: one
    read to the host for all of them (two blocking copies per request before)."""
    greedy = [e for e in entries if e.num_draft_tokens and e.request.params.greedy]
    if not greedy:
        return {}
    flat = _rows_on(logits, [r for e in greedy for r in rows_of[id(e)]]).argmax(dim=-1).tolist()
    out, at = {}, 0
    for e in greedy:
        n = len(rows_of[id(e)])
        out[id(e)], at = flat[at:at + n], at + n
    return out
