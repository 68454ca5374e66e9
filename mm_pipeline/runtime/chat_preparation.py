"""A parsed chat turned into what the engine runs (``OmniRuntime.prepare_chat`` asks this): its token
ids with one placeholder span per media unit, sized before any encoding (each item's plan comes
from the encoder cache's manifest or the media's metadata) -- the one contract embedding streaming
needs. Every media item is ingested and planned (concurrently), the request's limits checked
before a pixel is decoded, then the prompt laid out (template + BPE). Everything that blocks runs
on the worker pools; this object is used from the event loop.

A media item's error names the content part it came from (``messages[2].content[1]: ...``, its
``loc``, a 400's ``param``); ``PreparedChat.parts`` keeps those places for the errors of its decode.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mm_pipeline.encode.plan import MediaPlan
from mm_pipeline.encode.planner import MediaPlanner
from mm_pipeline.errors import ContextLengthError, MediaError, Where
from mm_pipeline.media.flows import current_flow
from mm_pipeline.media.types import MediaItem
from mm_pipeline.media.worker_pool import WorkerPool
from mm_pipeline.prompt.layout import LaidOutPrompt, PromptLayout
from mm_pipeline.prompt.messages import ChatRequest, MediaRef
from mm_pipeline.runtime.embedding_stream import PlaceholderSpan

@dataclass(frozen=True)
class PreparedChat:
    """A chat laid out: token ids, one span per unit (prompt order), per plan its span indices, and
    the positions where the prefix cache keeps a window (media and message ends, prompt/layout.py)."""

    token_ids: list[int]
    spans: list[PlaceholderSpan]
    plans: list[MediaPlan]
    spans_of_plan: list[list[list[tuple[int, int]]]]  # per plan, per unit: (stream span, first row)
    checkpoints: tuple[int, ...] = ()
    parts: tuple[Where, ...] = ()  # per plan, the content part its media came from (MediaRef.loc)


# A chat without media under truncate_prompt_tokens may render to this many times the context
# before the engine cuts it: rendering tokenizes all of it, so the bound keeps that work bounded.
TRUNCATABLE_CONTEXTS = 4


def check_context(num_tokens: int, limit: int) -> None:
    """A prompt of ``num_tokens`` must leave room for one generated token within ``limit``."""
    # the engine checks too, but only once the request reaches it: failing here means no
    # media of a prompt that cannot fit is ever produced
    if num_tokens + 1 > limit:
        raise ContextLengthError(f"the prompt is {num_tokens} tokens; with one generated token it exceeds "
                                 f"the context limit of {limit} tokens")


def _which_item(exc: MediaError, k: int, n: int, ref: MediaRef) -> MediaError:
    """``exc`` saying which media item of the request failed: the part it came from (its ``loc``,
    a 400's ``param``), or its number where the request gave no parts (the offline API's items)."""
    if ref.loc:
        return exc.located(f"{ref.loc}: {exc}", ref.loc)
    return exc.located(f"media item {k + 1} of {n}: {exc}", ())


class ChatPreparation:
    """``prepare``: a chat's media ingested and planned, its prompt laid out, within the context
    ``max_model_len`` (the engine's, capped at its Full pool)."""

    def __init__(self, layout: PromptLayout, planner: MediaPlanner, pool: WorkerPool, text_pool: WorkerPool,
                 max_model_len: int) -> None:
        self.layout = layout
        self.planner = planner
        self.pool = pool  # media work: ingest, plan, decode (requests take turns)
        self.text_pool = text_pool  # template + BPE of chats with several media items
        self.max_model_len = max_model_len

    async def prepare(self, chat: ChatRequest, truncate: bool = False, salt: str | None = None, *,
                      layout_only: bool = False) -> PreparedChat:
        """Ingest and plan every media item (concurrently), then lay the prompt out.

        ``truncate`` (the request has ``truncate_prompt_tokens``): a chat without media may render
        to up to ``TRUNCATABLE_CONTEXTS`` times the context, which the engine then cuts to its last
        tokens (a chat with media must fit: media is never cut). ``salt``: the request's cache_salt,
        which keys its media apart from other salts' (encoder cache, planning shared between requests).
        ``layout_only``: the token ids are all that is wanted (``POST /tokenize``): the plans read
        the cache's manifests only, never its rows (``MediaPlanner.plan``), and are not to be started.

        A chat with one media item takes one hop to the worker pool when it can: ingest, plan from
        the cache manifest and lay out in the same job (``_one_hop``). A repeat or a new question
        about cached media thus pays one hand-off instead of three (ingest, plan, layout:
        each a worker wake-up and a return to the loop, ~0.3 ms apiece on the 2-core host, measured
        in a same-prefix request of ~7 ms; README "Overlap, measured")."""
        refs: list[MediaRef] = chat.media
        if not truncate or refs:
            prepared = await self._within(chat, refs, self.max_model_len, salt, layout_only)
        else:
            bound = self.max_model_len * TRUNCATABLE_CONTEXTS
            try:
                prepared = await self._within(chat, refs, bound, salt, layout_only)
            except ContextLengthError as exc:
                raise ContextLengthError(f"{exc}: truncate_prompt_tokens cuts a chat of at most "
                                         f"{TRUNCATABLE_CONTEXTS}x the context ({bound} tokens)") from None
        for plan in prepared.plans:  # its encoder jobs take the request's turns (media/flows.py)
            plan.flow, plan.priority = current_flow()
        return prepared

    async def _within(self, chat: ChatRequest, refs: list[MediaRef], bound: int, salt: str | None,
                      layout_only: bool) -> PreparedChat:
        """``prepare`` within ``bound`` tokens (the context, or the truncatable bound)."""
        # a chat of more messages than the bound can hold fails first, before its media is fetched
        # or a part of it walked (O(1): each message's markup costs at least its special tokens)
        self.layout.check_markup(len(chat.turns), bound, options=chat.options)
        self.layout.template.check_kwargs(chat.options.kwargs)  # a 400 before any media work
        self.planner.check_request(refs)
        if len(refs) == 1:
            got = await self.pool.run(self._one_hop, chat, refs[0], salt, layout_only)
            if isinstance(got, PreparedChat):
                return got
            plans = [await self._plan_item(0, 1, refs[0], got, salt, layout_only)]
        else:
            plans = await self._plan_all(refs, salt, layout_only)
        self.planner.check_plans(plans)  # request budgets, before any pixel is decoded
        laid = await self.text_pool.run(self.layout.render, chat, plans, bound)  # template + BPE
        check_context(len(laid.token_ids), bound)
        return self._prepared(laid, plans, refs)

    async def _plan_all(self, refs: list[MediaRef], salt: str | None, layout_only: bool) -> list[MediaPlan]:
        """Every item loaded and planned concurrently. When one fails, the others are cancelled and
        awaited before the error goes out: ``gather`` alone left them running, so a request
        answered 400 kept up to 31 decodes on the media workers that nobody would use. A cancelled
        item leaves its planning pass (``MediaPlanner.plan``'s SingleFlight), which stops that
        decode only when no other request waits for the same media."""
        return await gather_or_cancel([asyncio.ensure_future(self._plan_item(k, len(refs), r, None, salt,
                                                                             layout_only))
                                       for k, r in enumerate(refs)])

    async def _plan_item(self, k: int, n: int, ref: MediaRef, item: MediaItem | None, salt: str | None,
                         layout_only: bool) -> MediaPlan:
        """Media item ``k`` of ``n``: loaded (unless ``item`` is it, already ingested) and planned."""
        try:
            item = item if item is not None else await self.planner.load(ref, salt)
            return await self.planner.plan(item, salt, layout_only=layout_only)
        except MediaError as exc:
            raise _which_item(exc, k, n, ref) from exc

    def _one_hop(self, chat: ChatRequest, ref: MediaRef, salt: str | None,
                 layout_only: bool) -> PreparedChat | MediaItem | None:
        """Worker thread: the chat's one media item ingested and, when its manifest is cached,
        planned and the prompt laid out (text tokenization runs here rather than on the text pool:
        this media request's own worker is already running). Else the ingested item (None: a
        source only ``planner.load`` takes) for the usual path."""
        try:
            item, plan = self.planner.plan_warm(ref, salt, layout_only=layout_only)
        except MediaError as exc:
            raise _which_item(exc, 0, 1, ref) from exc
        if plan is None:
            return item
        self.planner.check_plans([plan])
        laid = self.layout.render(chat, [plan], self.max_model_len)
        check_context(len(laid.token_ids), self.max_model_len)
        return self._prepared(laid, [plan], [ref])

    @staticmethod
    def _prepared(laid: LaidOutPrompt, plans: list[MediaPlan], refs: list[MediaRef]) -> PreparedChat:
        # a unit fills one span, or (a video's sound segment) several spans, each from its own row
        spans, spans_of_plan = [], []
        for p, (plan, ranges) in enumerate(zip(plans, laid.unit_spans)):
            pieces: list[list[tuple[int, int]]] = [[] for _ in plan.units]
            for (start, end), (unit, row) in zip(ranges, laid.pieces(p)):
                pieces[unit].append((len(spans), row))
                spans.append(PlaceholderSpan(start, end, plan.units[unit].key))
            spans_of_plan.append(pieces)
        order = sorted(range(len(spans)), key=lambda i: spans[i].start)
        where = {old: new for new, old in enumerate(order)}
        return PreparedChat(list(laid.token_ids), [spans[i] for i in order], plans,
                            [[[(where[i], row) for i, row in unit] for unit in pieces] for pieces in spans_of_plan],
                            laid.boundaries, tuple(ref.loc for ref in refs))


async def gather_or_cancel(tasks: list[asyncio.Future]) -> list:
    """Every task's result in order; when one raises, the others are cancelled and awaited before
    its exception goes out as it is. ``asyncio.gather`` alone leaves them running, unseen, holding
    what they hold (media workers, engine slots); ``TaskGroup`` would wrap the error in an
    ExceptionGroup the callers' handlers do not catch."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
