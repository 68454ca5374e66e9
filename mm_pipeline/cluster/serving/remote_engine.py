"""The engine the ingress's FastAPI app talks to when the LLM runs in Ray Serve replicas.

``create_app(engine, settings)`` (mm_pipeline/server/app.py) takes anything with OmniEngine's API;
this is that API over a ``DeploymentHandle`` to the LLM deployment, so the ingress serves the very
same app -- every endpoint, SSE, uploads, metrics, errors -- with generation in other processes:

* ``generate`` / ``generate_prompt`` build the request's :class:`RouteKey` (tokenizer only, on a
  worker thread: a long prompt must not freeze every other request and /health of this ingress)
  and call the LLM deployment with it as ``route=``; the deployment's request router picks the
  replica;
* uploaded files the messages name are read here and sent with the request (they live on the
  ingress's disk, which a replica on another node cannot see) -- after the request's media item
  count and each file's size are checked against the replicas' limits, as a single process does;
* a replica that dies or is unreachable before it produced a token, or whose engine stopped
  (:class:`EngineStopped`): the request is sent again (``retries`` times; the router has dropped a
  dead replica by then, and is told to skip a stopped one), so the client sees nothing; after the
  first token a resend would repeat text, so the request ends with ``ServerBusy`` (HTTP 503 with
  Retry-After before a response started; an error event in a started stream);
* with an encoder tier, each media item is first encoded there (``_encode_on_tier``) into the
  shared encoder cache, where the LLM replica finds it;
* ``prompt_token_ids`` (``POST /tokenize``) asks an LLM replica, where the chat template and the
  media planner are; ``max_model_len`` is the replicas' context limit from their stats;
* ``stats()`` is every LLM replica's last snapshot (:class:`ReplicaStats`: one Serve broadcast asks
  them all, replica_metrics.py), refreshed in the background, so ``/health`` and ``/metrics`` never
  wait on a replica; a replica that fails its answer (dying, its engine stopped) is left out of that
  refresh. A refresh waits at most ``STATS_TIMEOUT_S``, each replica's answer used as it arrives
  (replica_snapshots.py): one that has not answered by then keeps its last snapshot, marked late,
  for up to ``STATS_STALE_S``, and is named in a log line. Once no replica has answered for
  ``STATS_STALE_S`` ``stats()`` raises (``/health`` answers 503) instead of serving old snapshots of
  replicas that may all be gone. Not on the first failed refresh: while Serve replaces a replica
  that stopped answering, /health must not flap.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from llm_core.engine.sampling.generation_config import GenerationDefaults
from llm_core.engine.sampling import SamplingParams
from mm_pipeline.cluster.serving.llm_replica import EngineStopped, ReplicaFailure
from mm_pipeline.cluster.serving.replica_metrics import ReplicaStats
from mm_pipeline.cluster.serving.replica_snapshots import ReplicaSnapshots, gather_answers
from mm_pipeline.cluster.serving.shared_files import SharedFile
from mm_pipeline.cluster.serving.route_key import RouteKey, key_of_messages, key_of_prompt, media_key
from mm_pipeline.errors import InternalError, InvalidInputError, MediaTooLarge, ServerBusy
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.prompt.messages import parse_messages

if TYPE_CHECKING:
    from mm_pipeline.runtime.config import OmniEngineConfig

log = logging.getLogger(__name__)

STATS_MAX_AGE_S = 1.0  # a snapshot older than this is refreshed in the background
STATS_STALE_S = 10 * STATS_MAX_AGE_S  # no replica answered for this long: unhealthy (one replica: left out)
STATS_TIMEOUT_S = 5.0  # a refresh's deadline: a replica not answered by then is silent (it must not pin it)

T = TypeVar("T")


def own_request(call: Callable[[], T]) -> T:
    """``call()`` -- a ``DeploymentHandle`` call (``.remote(...)``) -- as a Serve request of its own.

    Serve gives every handle call made while the ingress serves an HTTP request that request's
    internal id, and a request router hands the replica it chose to the waiting call with that id
    (``RequestRouter``'s exact matching; only a ``FIFOMixin`` router falls back to queue order). The
    ``n`` choices of one request, or the encoder calls of its media items, then shared one id:
    one call got its replica and the others were routed again and again for good -- the request
    hung and the router spun on the ingress's event loop, stalling every other request. Our
    routers count each replica's in-flight work by that id too. So each call gets a fresh id, in a
    copy of the caller's context (the request id its logs carry stays)."""
    return contextvars.copy_context().run(_with_own_id, call)


def _with_own_id(call: Callable[[], T]) -> T:
    from ray.serve import context  # only ever called with Ray installed (a handle call follows)

    context._set_request_context(_internal_request_id=uuid.uuid4().hex)
    return call()


def file_ids(messages: list[dict]) -> list[str]:
    out = []
    for m in messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "file":
                fid = (part.get("file") or {}).get("file_id")
                if isinstance(fid, str):
                    out.append(fid)
    return out


def media_parts(messages: list[dict]) -> dict[str, dict]:
    """Each distinct media part of ``messages`` by its content key, first occurrence."""
    parts: dict[str, dict] = {}
    for m in messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            key = media_key(part) if isinstance(part, dict) else None
            if key is not None:
                parts.setdefault(key, part)
    return parts


class RemoteEngine:
    def __init__(self, handle: Any, tokenizer: Any, model_name: str, retries: int = 2, *,
                 encoders: Any = None, encoder_timeout_s: float = 120.0,
                 generation_defaults: GenerationDefaults | None = None, limits: MediaLimits | None = None,
                 config: OmniEngineConfig | None = None) -> None:
        import ray.exceptions

        # OmniEngine's: the replicas' engine config (one for all), for what the ingress's ChatService
        # reads of it: max_queue, so a request of more choices than a replica admits is a 400, not a
        # 429 no retry ends (a batch line's retries never would)
        self.config = config

        # OmniEngine's: what the ingress's ChatService fills a request's unset sampling fields with
        self.generation_defaults = generation_defaults or GenerationDefaults()
        # the replicas' media limits: uploads are read and sent, and with an encoder tier media is
        # encoded, before any replica sees the request, so its item counts and file sizes are checked
        # here first (a request of 500 images is a 400 before any is read or encoded)
        self.limits = limits or MediaLimits()
        self.handle, self.tokenizer, self.model_name, self.retries = handle, tokenizer, model_name, retries
        self.encoders, self.encoder_timeout_s = encoders, encoder_timeout_s
        self.encoder_failures = 0  # encoder-tier calls that failed or timed out (the LLM replica encoded)
        self._replica_gone = (ray.exceptions.RayActorError,)
        self._task_error = ray.exceptions.RayTaskError
        self._resolver: Callable[[str], tuple[bytes | Path, str | None]] | None = None
        self._snapshots = ReplicaSnapshots()  # every replica's last answer; .view is what stats() serves
        self._stats_error: str | None = None  # why the last refresh failed; None once one succeeds
        self._refreshing: asyncio.Task | None = None
        self.resends = 0  # requests sent again after their replica died (tests read it)

    # ---- OmniEngine's API -----------------------------------------------------------------------
    async def generate(self, messages: list[dict], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[Any]:
        key = await asyncio.to_thread(key_of_messages, messages, self._encode, salt=cache_salt)
        files = await self._files(messages)
        if self.encoders is not None:
            # the request's items take one turn per round in the tier's queues, at its priority
            await self._encode_on_tier(messages, files, cache_salt, flow=request_id or f"tier-{uuid.uuid4().hex}",
                                       priority=priority)
        async for d in self._stream("chat", messages, params, request_id, key, files, priority, cache_salt):
            yield d

    async def generate_prompt(self, prompt: str | list[int], params: SamplingParams, *,
                              request_id: str | None = None, priority: int = 0,
                              cache_salt: str | None = None) -> AsyncIterator[Any]:
        key = None
        if self.tokenizer is not None or not isinstance(prompt, str):
            key = await asyncio.to_thread(key_of_prompt, prompt, self._encode, salt=cache_salt)
        async for d in self._stream("prompt", prompt, params, request_id, key, None, priority, cache_salt):
            yield d

    async def prompt_token_ids(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                               add_special_tokens: bool = False) -> list[int]:
        """``POST /tokenize``: OmniEngine's answer from an LLM replica (the chat template and media
        planning live there; no route key, so the least loaded one), with the files the messages
        name. A replica gone or stopped is a 503 (retry), its typed errors raise here as in
        ``generate``."""
        files = await self._files(messages) if messages is not None else None
        try:
            got = await own_request(lambda: self.handle.prompt_token_ids.remote(
                messages=messages, prompt=prompt, add_special_tokens=add_special_tokens, files=files))
        except self._replica_gone as exc:
            raise ServerBusy(f"the LLM replica serving this request died ({type(exc).__name__}); "
                             f"retry the request") from None
        except self._task_error as exc:
            raise InternalError(f"LLM replica failed: {exc}") from None
        if isinstance(got, ReplicaFailure):
            raise got.error
        return got

    @property
    def max_model_len(self) -> int:
        """The replicas' context limit (one config for all), from their last stats snapshots (the
        ingress waits for a first one before it serves)."""
        if self._snapshots.view is None:
            raise ServerBusy("no LLM replica has reported its stats yet")
        return self._snapshots.view.max_context_tokens

    def set_file_resolver(self, fn: Callable[[str], tuple[bytes | Path, str | None]]) -> None:
        self._resolver = fn

    def stats(self) -> ReplicaStats:
        age = time.monotonic() - self._snapshots.last_answer_at
        if age > STATS_MAX_AGE_S:
            self._refresh_soon()
        view = self._snapshots.view
        if view is None:
            raise RuntimeError("no LLM replica has reported its stats yet")
        if age > STATS_STALE_S:
            raise RuntimeError(f"no LLM replica has answered for {age:.0f} s "
                               f"(last error: {self._stats_error or 'none yet, still waiting'})")
        return view

    async def wait_for_replicas(self) -> None:
        """The ingress's start: wait until an LLM replica answers, then take the snapshots. A routed
        call first: it waits while Serve starts the replicas (the ingress may be up before them),
        where a broadcast to none raises at once and failed the ingress's start."""
        await own_request(self.handle.stats.remote)
        await self.refresh_stats()

    async def refresh_stats(self) -> None:
        """Ask every LLM replica for its snapshot (``LLMReplica.replica_stats``). Serve's broadcast,
        not a routed call: one routed call reached whichever replica the router picked, and the
        ingress's /metrics then jumped between replicas' counters. Each answer is used as it arrives,
        until ``STATS_TIMEOUT_S``; a replica whose answer fails is left out, one silent by then keeps
        its last snapshot a while (replica_snapshots.py). None answering fails the refresh: a
        ``TimeoutError`` naming the silent replicas, else the first error."""
        started = time.monotonic()
        # a round that waits only for the replicas silent in the last one ends one refresh period in
        # (replica_snapshots.gather_answers): the others' snapshots then stay that fresh
        tally = await gather_answers(self.handle.broadcast("replica_stats"), STATS_TIMEOUT_S, self._snapshots.answer,
                                     expect_silent=self._snapshots.unanswered, settle_s=STATS_MAX_AGE_S)
        self._snapshots.end_round(started, tally, STATS_STALE_S)
        if tally.answered:
            return
        if tally.silent:
            named = self._snapshots.silence()
            failed = f"; {len(tally.errors)} failed, first: {type(tally.errors[0]).__name__}" if tally.errors else ""
            raise TimeoutError(f"no LLM replica answered within {STATS_TIMEOUT_S:g} s: {tally.silent} silent"
                               f"{': ' + named if named else ''}{failed}")
        raise tally.errors[0] if tally.errors else RuntimeError("no LLM replica answered")

    def shutdown(self) -> None:
        """The replicas belong to Ray Serve (``serve.delete`` stops them), not to this proxy."""

    # ---- internal helpers -------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer is not None else []

    def _refresh_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._refreshing is None or self._refreshing.done():
            async def refresh() -> None:
                try:
                    await self.refresh_stats()  # bounded by STATS_TIMEOUT_S itself
                    self._stats_error = None
                except Exception as exc:  # noqa: BLE001 - a replica restarting: the snapshot ages (stats())
                    first = self._stats_error is None
                    self._stats_error = f"{type(exc).__name__}: {exc}"
                    # once per outage: /health polls this every second or so while it lasts
                    log.log(logging.WARNING if first else logging.DEBUG, "LLM replica stats refresh failed: %s",
                            self._stats_error)
            self._refreshing = loop.create_task(refresh())

    async def _files(self, messages: list[dict]) -> dict[str, SharedFile]:
        """The uploaded files ``messages`` name, read to go with the request -- after what a
        single-process server checks before it reads any: the media items against the limits (400),
        then each file's size on disk against ``max_bytes`` (413). Read first, 40 uploads of 150 MiB
        were 6 GiB in this process before a replica refused the request."""
        await asyncio.to_thread(self._check_media, messages)
        out: dict[str, SharedFile] = {}
        if self._resolver is None:
            return out
        found: dict[str, tuple[bytes | Path, str | None]] = {}
        for fid in dict.fromkeys(file_ids(messages)):
            try:
                found[fid] = self._resolver(fid)
            except KeyError:
                continue  # the replica's resolver says "not found" with the usual error
        for fid, (data, _) in found.items():
            try:
                size = data.stat().st_size if isinstance(data, Path) else len(data)
            except FileNotFoundError:
                continue  # deleted meanwhile: the replica says "not found"
            self._check_size(fid, size)
        for fid, (data, name) in found.items():
            if isinstance(data, Path):
                data = await asyncio.to_thread(self._read_upload, fid, data)
                if data is None:
                    continue
            out[fid] = SharedFile(bytes(data), name)
        return out

    def _check_size(self, fid: str, size: int) -> None:
        if size > self.limits.max_bytes:
            raise MediaTooLarge(f"uploaded file {fid!r} is {size} bytes, over the {self.limits.max_bytes}-byte "
                                f"media limit (max_bytes)")

    def _read_upload(self, fid: str, path: Path) -> bytes | None:
        """At most ``max_bytes`` + 1 of ``path`` (it may have been replaced since it was sized);
        None once it is gone."""
        try:
            with path.open("rb") as f:
                data = f.read(self.limits.max_bytes + 1)
        except FileNotFoundError:
            return None
        self._check_size(fid, len(data))
        return data

    def _check_media(self, messages: list[dict]) -> None:
        """The request's media items against the limits a replica holds them to (parsed as it parses
        them: malformed messages fail here the same way)."""
        chat = parse_messages(messages)
        if (problem := self.limits.check_items([None if r.kind is None else r.kind.value
                                                 for r in chat.media])) is not None:
            raise InvalidInputError(problem)

    async def _encode_on_tier(self, messages: list[dict], files: dict[str, SharedFile],
                              salt: str | None = None, flow: str | None = None, priority: int = 0) -> None:
        """Each distinct media item to the encoder replica its content key hashes to, all at once;
        the LLM replica then finds their units in the shared cache. Failures only cost speed: a
        unit the tier did not deliver is a miss the LLM replica encodes (bad media included, which
        it reports with the usual typed error). ``salt``: the request's cache_salt, which keys the
        units the tier writes as the LLM replica will look for them (per tenant). ``flow``,
        ``priority``: the request's, which its items' work on the replicas is done as
        (media/flows.py): one request, one turn per round, however many items it has."""
        parts = await asyncio.to_thread(media_parts, messages)  # hashes data URLs: megabytes
        if not parts:
            return
        calls, responses = [], []
        for key, part in parts.items():
            fid = (part.get("file") or {}).get("file_id") if part.get("type") == "file" else None
            sent = {fid: files[fid]} if fid in files else None
            responses.append(own_request(lambda: self.encoders.encode.remote(part, sent, media_key=key, salt=salt,
                                                                             flow=flow, priority=priority)))
            calls.append(asyncio.ensure_future(self._awaited(responses[-1])))
        try:
            done, pending = await asyncio.wait(calls, timeout=self.encoder_timeout_s)
        finally:  # timed out, or the client left while we waited: stop what is still running --
            # on the encoder replica too (cancelling the wait alone leaves a call Serve already
            # assigned running there, holding its slot while this replica encodes the same media)
            for c, response in zip(calls, responses):
                if not c.done():
                    c.cancel()
                    response.cancel()
        failed = len(pending) + sum(c.exception() is not None for c in done)
        if failed:
            self.encoder_failures += failed
            log.warning("encoder tier: %d of %d media items not encoded there; the LLM replica encodes them",
                        failed, len(calls))

    @staticmethod
    async def _awaited(response: Any) -> Any:
        return await response

    async def _stream(self, kind: str, payload: Any, params: SamplingParams, request_id: str | None,
                      key: RouteKey | None, files: dict[str, SharedFile] | None,
                      priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[Any]:
        attempt = 0
        avoid: list[str] = []  # replicas whose engine stopped: the router skips them on a resend
        while True:
            gen = own_request(lambda: self.handle.options(stream=True).generate.remote(
                kind, payload, params, request_id, files, route=key, avoid=tuple(avoid), priority=priority,
                cache_salt=cache_salt))
            produced = finished = False
            try:
                try:
                    async for item in gen:
                        if isinstance(item, ReplicaFailure):
                            raise item.error
                        produced = True
                        finished = item.finished
                        yield item
                    return
                except EngineStopped as exc:  # alive but useless until Serve replaces it: as if gone
                    if exc.replica and exc.replica not in avoid:
                        avoid.append(exc.replica)
                    gone: Exception = exc
                except self._replica_gone as exc:
                    gone = exc
                except self._task_error as exc:
                    raise InternalError(f"LLM replica failed: {exc}") from None
                if produced or attempt >= self.retries:
                    raise ServerBusy(f"the LLM replica serving this request died ({type(gone).__name__}); "
                                     f"retry the request") from None
                attempt += 1
                self.resends += 1
                log.warning("LLM replica died before the first token of %s (%s); sending it again (%d/%d)",
                            request_id, type(gone).__name__, attempt, self.retries)
            finally:
                if not finished:
                    gen.cancel()  # client gone or error: abort on the replica, free its KV
