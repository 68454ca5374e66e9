"""Phase-free continuous batching over the dual KV pool.

Every step each request gets ``min(ready - num_computed, chunk cap, budget left)`` new tokens, so a
fresh prompt (chunked prefill), a prefix-cache hit and a decode step share one code path. Running
requests go first, oldest first; waiting ones are admitted while both pools have room for their
first chunk (checking only one pool mis-admits). When a running request cannot get pages, the
youngest running request is preempted (its KV dropped, recomputed later) instead of failing. Under
the ``priority`` queue policy "oldest" and "youngest" read "most urgent" and "least urgent"
(``QueuePolicy.rank``), and a waiting request that finds no seat or no pages preempts running
requests of strictly lower priority, its chunk's pages evicted from the prefix cache first. A
request that does not fit even alone ends with "error" (not counted as a preemption); the engine
caps each request's context at the Full pool (``LLMEngine.max_context_tokens``), so only an SWA pool
too small for one request's window and chunk gets there.

SWA pages wholly behind the window are released after every multi-token chunk and every
``swa_release_interval`` decoded tokens:

    window W = 4, page_size 2, next query at position N = 9 sees keys 6..9
    logical pages:  [0 1][2 3][4 5][6 7][8 9]
                    free  free free  keep keep        first needed key = N - W + 1 = 6
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from llm_core.kvcache.dual_pool import DualKVPool
from llm_core.engine.outputs import ErrorKind
from llm_core.kvcache.prefix_cache import NoPrefixCache, PrefixCache
from llm_core.engine.queue_policy import QueuePolicy
from llm_core.engine.request import Request, RequestStatus
from llm_core.engine.scheduled_batch import ScheduledBatch, ScheduledRequest
from llm_core.engine.stats import TokenCounters


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits. ``max_chunk_tokens`` caps one request's new tokens per step (None: budget)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_chunk_tokens: int | None = None
    swa_release_interval: int = 16

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1 or None, got {self.max_chunk_tokens}")
        if self.swa_release_interval < 1:
            raise ValueError(f"swa_release_interval must be >= 1, got {self.swa_release_interval}")

    @property
    def chunk_cap(self) -> int:
        return self.max_chunk_tokens or self.max_num_batched_tokens


class Scheduler:
    """Owns the waiting queue, the running set and every page a request holds."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: DualKVPool,
        window: int | None,
        prefix_cache: PrefixCache | None = None,
        queue_policy: QueuePolicy | None = None,
        draft_tokens: Callable[[Request, int], int] | None = None,
    ) -> None:
        """``draft_tokens(request, num_running)``: how many draft tokens a decoding request verifies
        this step (speculative decoding; None: never)."""
        self.config = config
        self.draft_tokens = draft_tokens
        self.queue_policy = queue_policy or QueuePolicy()
        self.pool = pool
        self.window = window
        self.prefix_cache = prefix_cache or NoPrefixCache()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by queue_policy.rank (oldest / most urgent first)
        self.num_preemptions = 0
        self.counters = TokenCounters()  # prompt / recomputed tokens, first prefix hits (cached_prompt_tokens)

    # ---- public API -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def cached_prompt_tokens(self, request: Request) -> int:
        return self.counters.cached_prompt_tokens(request)

    @property
    def num_prompt_tokens(self) -> int:
        return self.counters.num_prompt_tokens

    @property
    def num_recomputed_tokens(self) -> int:
        return self.counters.num_recomputed_tokens

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts; allocate their pages."""
        batch = ScheduledBatch()
        policy = self.queue_policy
        # priority: running requests less urgent than the most urgent waiting one come after the
        # admissions, so a long low-priority prefill cannot hold an urgent request out for its length
        before = min(self.waiting, key=policy.rank) if policy.uses_priority and self.waiting else None
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, before)
        if batch.preempted:
            return batch  # pools are tight: do not admit new work in the same step
        budget = self._admit(policy.order(self.waiting, self.prefix_cache.peek, time.monotonic()), batch, budget)
        if before is not None:
            self._schedule_running(batch, budget, None)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, before: Request | None) -> int:
        """Schedule running requests without an entry yet, in rank order, up to the first one that
        ``before`` (a waiting request) outranks (None: all). Returns the budget left."""
        scheduled = {id(e.request) for e in batch.entries}  # (empty but after the admissions)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in scheduled:
                i += 1
                continue
            if before is not None and self.queue_policy.preempts(before, req):
                break
            n = self._num_new(req, budget)
            if n == 0:
                i += 1
                continue
            k = self._drafts(req, n, budget)  # speculative: allocated here or not at all, never preempting
            if k:
                n = k + 1
            else:
                n, regained = self._allocate_or_preempt(req, n, batch)
                budget += regained
            if n:
                batch.entries.append(ScheduledRequest(req, req.num_computed_tokens, n, k))
                budget -= n
                i += 1
            elif req.status is RequestStatus.RUNNING:
                # Alone and still no room: it never will fit. Fail it instead of looping.
                self._fail_unfittable(req, batch)
        return budget

    def _admit(self, order: list[Request], batch: ScheduledBatch, budget: int) -> int:
        """Admit waiting requests in ``order`` while seats, budget and pages last. Returns the budget left."""
        policy = self.queue_policy
        floor: tuple[int, int] | None = None  # rank of the most urgent request preempted here
        for req in order:
            if budget <= 0 or (len(self.running) >= self.config.max_num_seqs
                               and not policy.preempts(req, self.running[-1])):
                break
            if floor is not None and policy.rank(req) > floor:
                break  # what a preemption freed is not for a request less urgent than its victim
            if not req.full_pages:
                if not self.prefix_cache.prefetch(req):
                    req.status = RequestStatus.LOADING
                    continue  # its cached prefix is coming from L3 off this thread; others go on
                req.status = RequestStatus.WAITING
                self._match_prefix(req)
            n = self._num_new(req, budget)
            if n == 0:
                self._unmatch(req)  # waiting requests hold no pages between steps
                continue  # its embeddings are not ready yet; let younger ready requests pass
            if len(self.running) >= self.config.max_num_seqs:  # no seat: it outranks the last one (above)
                floor = policy.rank(self.running[-1])
                budget += self._preempt_scheduled(self.running[-1], batch)
            fits = self._try_allocate(req, n)
            while not fits and self.running and policy.preempts(req, self.running[-1]):
                floor = policy.rank(self.running[-1])  # victims go least urgent first: the last is the floor
                budget += self._preempt_scheduled(self.running[-1], batch)
                fits = self._try_allocate(req, n)
            if not fits:
                # Alone in the pools, a smaller first chunk may still fit (a tight SWA pool).
                n = self._fit(req, n) if self._pool_empty(but=req) else 0  # (its own matched pages aside)
                if not (n and self._try_allocate(req, n)):
                    self._unmatch(req)
                    if self._pool_empty():
                        self._fail_unfittable(req, batch)
                        continue
                    break  # keep arrival order: do not let a smaller younger request jump the queue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            # its lookup counts once, not once per step it waited (a re-admission after a
            # preemption apart: the prefix cache tells them by Request.num_preemptions)
            self.prefix_cache.admitted(req)
            self.counters.admitted(req)
            bisect.insort(self.running, req, key=policy.rank)
            batch.entries.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= n
        return budget

    def after_step(self, batch: ScheduledBatch, computed_ends: dict[int, int] | None = None) -> None:
        """Advance progress of every scheduled request and release SWA pages behind its window.

        ``computed_ends`` (speculative decoding): for an entry (by ``id``) whose drafts were not all
        accepted, the position its verified tokens end at; the KV past it is rolled back first (its
        pages freed in both pools), so neither the prefix cache nor the SWA release ever sees it."""
        for e in batch.entries:
            req = e.request
            if req.finished:
                continue
            end = e.end if computed_ends is None else computed_ends.get(id(e), e.end)
            if not e.start < end <= e.end:
                raise RuntimeError(f"{req.request_id}: computed end {end} outside its step [{e.start}, {e.end}]")
            self.counters.computed(req, e.start, end)
            req.num_computed_tokens = end
            if end < e.end:
                self._rollback(req)
            req.tokens_since_swa_release += end - e.start
            # the cache sees the new pages before the request lets go of out-of-window SWA pages
            self.prefix_cache.on_computed(req, self.pool)
            if e.num_new_tokens > 1 or req.tokens_since_swa_release >= self.config.swa_release_interval:
                self._release_behind_window(req)

    def finish(self, request: Request, reason: str, error: str | None = None,
               error_kind: ErrorKind | None = None) -> None:
        """End a request (any state) and give back all of its pages."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self._release_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error, request.error_kind = error, error_kind

    def release_all_behind_window(self) -> None:
        """Release every running request's out-of-window SWA pages now (the interval's slack)."""
        for req in self.running:
            self._release_behind_window(req)

    # ---- internal helpers -------------------------------------------------------------------
    def _drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens for ``req`` this step, with pages for 1 + k tokens allocated (0: none, nothing
        allocated). Only a decoding request drafts: its one new token is its last sampled one."""
        if self.draft_tokens is None or n != 1 or req.num_computed_tokens < req.num_prompt_tokens:
            return 0
        k = min(self.draft_tokens(req, len(self.running)), budget - 1, self.config.chunk_cap - 1)
        if k <= 0:
            return 0
        need_full, need_swa = self._pages_needed(req, 1 + k)
        if need_full > self.pool.full.num_free or need_swa > self.pool.swa.num_free:
            return 0  # drafts never evict cached prefixes nor preempt anybody
        return k if self._try_allocate(req, 1 + k) else 0

    def _rollback(self, req: Request) -> None:
        """Free the pages past ``num_computed_tokens`` (they held only rejected drafts' KV), leaving
        ceil(num_computed / page_size) pages as after any step. Nothing freed here was ever in the
        prefix cache (it only takes whole pages below num_computed_tokens) nor released as SWA (the
        release keeps every page from the window of num_computed_tokens on)."""
        keep = -(-req.num_computed_tokens // self.pool.page_size)
        self.pool.full.free(req.full_pages[keep:])
        self.pool.swa.free(req.swa_pages[keep:])  # -1 entries are skipped
        del req.full_pages[keep:]
        del req.swa_pages[keep:]

    def _num_new(self, req: Request, budget: int) -> int:
        n = req.schedulable_until() - req.num_computed_tokens
        return max(0, min(n, budget, self.config.chunk_cap))

    def _pages_needed(self, req: Request, n: int) -> tuple[int, int]:
        ps = self.pool.page_size
        end_pages = -(-(req.num_computed_tokens + n) // ps)
        need_full = max(0, end_pages - len(req.full_pages))
        need_swa = max(0, end_pages - len(req.swa_pages)) if self.pool.has_swa else 0
        return need_full, need_swa

    def _make_room(self, req: Request, n: int) -> None:
        """Let the prefix cache evict what ``n`` more tokens of ``req`` lack (before anyone is preempted)."""
        need_full, need_swa = self._pages_needed(req, n)
        short_full, short_swa = need_full - self.pool.full.num_free, need_swa - self.pool.swa.num_free
        if short_full > 0 or short_swa > 0:
            self.prefix_cache.make_room(self.pool, max(0, short_full), max(0, short_swa))

    def _try_allocate(self, req: Request, n: int) -> bool:
        need_full, need_swa = self._pages_needed(req, n)
        if not need_full and not need_swa:
            return True  # most decode steps: the token lands on a page the request holds
        self._make_room(req, n)
        if need_full > self.pool.full.num_free or need_swa > self.pool.swa.num_free:
            return False
        req.full_pages += self.pool.full.allocate(need_full)
        if self.pool.has_swa:
            req.swa_pages += self.pool.swa.allocate(need_swa)
        else:
            req.swa_pages += [-1] * need_full  # keep both tables one logical index long
        req.swa_peak_pages = max(req.swa_peak_pages, req.num_live_swa_pages if self.pool.has_swa else 0)
        return True

    def _allocate_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> tuple[int, int]:
        """Allocate for up to ``n`` new tokens of ``req``; returns how many got pages (0: ``req``
        itself was preempted, or it is alone and does not fit: it stays RUNNING for the caller to
        fail) and the budget regained from victims' entries of this step. On shortage: release SWA
        slack, then shrink the chunk to what fits, then preempt the youngest (least urgent) running
        request until at least one token fits."""
        if self._try_allocate(req, n):
            return n, 0
        self.release_all_behind_window()
        regained = 0
        while True:
            self._make_room(req, n)  # cached pages go before the chunk shrinks or anyone is preempted
            fit = self._fit(req, n)
            if fit and self._try_allocate(req, fit):
                return fit, regained
            victim = self.running[-1]
            if victim is req and self._alone(req):
                return 0, regained  # preempting it would free only its own pages: a failure, not a preemption
            regained += self._preempt_scheduled(victim, batch)
            if victim is req:
                return 0, regained

    def _fit(self, req: Request, n: int) -> int:
        """The most of the next ``n`` tokens whose pages the free pools can hold now (0 if none)."""
        ps = self.pool.page_size
        end = (len(req.full_pages) + self.pool.full.num_free) * ps
        if self.pool.has_swa:
            end = min(end, (len(req.swa_pages) + self.pool.swa.num_free) * ps)
        return max(0, min(n, end - req.num_computed_tokens))

    def _pool_empty(self, but: Request | None = None) -> bool:
        """No request (``but`` aside: the one being admitted holds its matched prefix's pages) holds
        pages (a prefix cache may, but it was asked to make room already)."""
        return not self.running and not any(r.full_pages for r in self.waiting if r is not but)

    def _alone(self, req: Request) -> bool:
        """``req`` is the only running request and no other request holds pages."""
        return self.running == [req] and not any(r.full_pages for r in self.waiting)

    def _fail_unfittable(self, req: Request, batch: ScheduledBatch) -> None:
        self.finish(req, "error", (
            f"request {req.request_id} ({req.num_tokens} tokens) does not fit in the KV pools even "
            f"alone ({self.pool.full.num_pages} Full / {self.pool.swa.num_pages} SWA pages of "
            f"{self.pool.page_size} tokens)"
        ), ErrorKind.CONTEXT_LENGTH)
        batch.failed.append(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_pages(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)  # victims come youngest first, so the oldest ends up in front
        self.num_preemptions += 1

    def _preempt_scheduled(self, victim: Request, batch: ScheduledBatch) -> int:
        """Preempt ``victim`` in this step. Under the ``priority`` policy it may already hold an entry
        of this step (a more urgent waiting request takes its place, or a less urgent running one
        scheduled after the admissions needs its pages): the entry goes and its tokens' budget comes
        back (returned). Its pages for that entry were never computed, so nothing of them is cached."""
        entry = next((e for e in batch.entries if e.request is victim), None)
        if entry is not None:
            batch.entries.remove(entry)
        self._preempt(victim)
        batch.preempted.append(victim)
        return entry.num_new_tokens if entry is not None else 0

    def _match_prefix(self, req: Request) -> None:
        k = self.prefix_cache.match(req, self.pool)
        if k >= req.num_tokens:
            raise RuntimeError(f"prefix cache matched all {k} tokens of {req.request_id}; one must stay")
        req.num_computed_tokens = k
        req.num_cached_tokens = k

    def _unmatch(self, req: Request) -> None:
        """Give a waiting request's prefix hit back (it is matched again when it is admitted)."""
        self._release_pages(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0

    def _release_pages(self, req: Request) -> None:
        self.prefix_cache.release(req, self.pool)
        req.full_pages = []
        req.swa_pages = []
        req.swa_released_pages = 0

    def _release_behind_window(self, req: Request) -> None:
        req.tokens_since_swa_release = 0
        if self.window is None or not self.pool.has_swa:
            return
        first_needed = max(0, req.num_computed_tokens - self.window + 1)
        upto = min(first_needed // self.pool.page_size, len(req.swa_pages))
        if upto <= req.swa_released_pages:
            return
        dead = req.swa_pages[req.swa_released_pages:upto]
        self.pool.swa.free(dead)
        req.swa_pages[req.swa_released_pages:upto] = [-1] * len(dead)
        req.swa_released_pages = upto
