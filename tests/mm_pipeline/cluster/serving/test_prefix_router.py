"""The Serve-side routers without a cluster (Ray Serve's RequestRouter subclasses driven directly,
replicas as stand-ins carrying what the router reads): the affinity router ranks the replica that
was sent the prefix first, counts its own in-flight prefill as load, and forgets a replica that died;
both LLM routers skip a replica whose engine stopped or that a resend names; the encoder router sends
one content key to one replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from mm_pipeline.cluster.serving.encoder_router import ContentHashRouter  # noqa: E402
from mm_pipeline.cluster.serving.prefix_router import PrefixAffinityRouter, RoundRobinRouter  # noqa: E402
from mm_pipeline.cluster.serving.route_key import key_of_pieces  # noqa: E402

DEPLOYMENT = DeploymentID(name="LLM", app_name="test")


def replica(uid: str, load: float = 0, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT),
                           routing_stats={"load_tokens": load, **stats})


def request(rid: str, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(kwargs=kwargs, metadata=SimpleNamespace(internal_request_id=rid))


async def first_choice(router, replicas, pending) -> str:
    ranks = await router.choose_replicas(replicas, pending)
    return ranks[0][0].replica_id.unique_id


def test_affinity_router_follows_the_prefix_and_forgets_the_dead():
    async def run() -> None:
        router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        reps = [replica("a"), replica("b")]
        key = key_of_pieces([("tokens", list(range(160)))])
        pending = request("1", route=key)
        chosen = await first_choice(router, reps, pending)
        router.on_request_routed(pending, reps[0 if chosen == "a" else 1].replica_id, None)
        assert router._inflight.get(chosen) == key.total  # nothing was cached there: the whole prefill
        router.on_request_completed(reps[0 if chosen == "a" else 1].replica_id, "1")
        assert router._inflight.get(chosen) == 0
        longer = key_of_pieces([("tokens", list(range(200)))])
        assert await first_choice(router, reps, request("2", route=longer)) == chosen
        dead = reps[0 if chosen == "a" else 1]
        router.on_replica_actor_died(dead.replica_id)
        assert router.policy.index.match(longer.hashes, [chosen])[chosen] == 0

    asyncio.run(run())


def test_a_silent_redis_does_not_stall_the_routers_loop(silent_redis_url, max_loop_lag):
    """Serve runs the router on the handle's event loop, and the router's Redis calls ran on it: with
    a Redis that never answers, choose_replicas held the loop for the 0.25 s socket timeout, and
    with it every request routed through that ingress. The lookup now waits off the loop (a miss:
    routing by load) and the writes of on_request_routed and of a replica's death are queued."""
    async def run() -> float:
        router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(redis_url=silent_redis_url)
        reps = [replica("a", load=1000), replica("b")]

        async def work() -> None:
            for i in range(3):
                pending = request(str(i), route=key_of_pieces([("tokens", list(range(i, i + 160)))]))
                assert await first_choice(router, reps, pending) == "b"  # a miss: the less loaded
                router.on_request_routed(pending, reps[1].replica_id, None)
            router.on_replica_actor_died(reps[0].replica_id)

        try:
            return await max_loop_lag(work)
        finally:
            router.policy.index.close(drain_s=0.1)

    lag = asyncio.run(run())
    assert lag < 0.1, f"the router's loop stalled {lag * 1000:.0f} ms"


def test_encoder_router_sends_a_key_to_one_replica():
    async def run() -> None:
        router = ContentHashRouter(DeploymentID(name="Encoder", app_name="test"), DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        reps = [replica(f"e{i}") for i in range(4)]
        picks = {await first_choice(router, reps, request(str(i), media_key="video-1")) for i in range(5)}
        assert len(picks) == 1  # nothing in flight: the ring's owner every time
        spread = {await first_choice(router, reps, request(str(i), media_key=f"video-{i}")) for i in range(40)}
        assert len(spread) == 4

    asyncio.run(run())


def test_a_request_reported_completed_before_routed_leaves_no_load():
    """Ray Serve sets its done-callback before it waits for the replica to accept, and both reach
    the router through the event loop: a fast request (refused at once, one token) can be reported
    completed first. Its routing used to add load that was never taken off again (~7 % of 1200
    fast requests in a live run): the replica ranked worse for every later prompt, for good."""
    async def run() -> None:
        router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = replica("a"), replica("b")
        pending = request("1", route=key_of_pieces([("tokens", list(range(160)))]))
        await router.choose_replicas([a, b], pending)
        router.on_request_completed(a.replica_id, "1")
        router.on_request_routed(pending, a.replica_id, None)
        assert router._inflight.get("a") == 0
        encoders = ContentHashRouter(DeploymentID(name="Encoder", app_name="test"), DeploymentHandleSource.UNKNOWN)
        encoders.initialize_state()
        call = request("9", media_key="video")
        owner = (await encoders.choose_replicas([a, b], call))[0][0]
        encoders.on_request_completed(owner.replica_id, "9")
        encoders.on_request_routed(call, owner.replica_id, None)
        assert encoders._inflight.get(owner.replica_id.unique_id) == 0

    asyncio.run(run())


def test_llm_routers_skip_a_stopped_or_avoided_replica():
    """A replica whose engine died reported load 0 and held the best prefix match: the affinity
    router sent it every request of that prefix, the resends included. It now reports itself
    stopped (what LLMReplica.record_routing_stats says), and a resend names it in ``avoid``."""
    async def ranked(router, reps, pending) -> list[str]:
        return [rank[0].replica_id.unique_id for rank in await router.choose_replicas(reps, pending)]

    async def run() -> None:
        router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        key = key_of_pieces([("tokens", list(range(160)))])
        a, b = replica("a"), replica("b")
        router.policy.dispatched("a", key)  # the prefix is on a: a comes first while it serves
        assert (await ranked(router, [a, b], request("1", route=key)))[0] == "a"
        assert await ranked(router, [a, b], request("2", route=key, avoid=("a",))) == ["b"]
        stopped = replica("a", load=float("inf"), engine_stopped=True)
        assert await ranked(router, [stopped, b], request("3", route=key)) == ["b"]
        assert await ranked(router, [stopped, b], None) == ["b"]  # stats calls too
        # none left: every candidate, so the request fails fast (a 503) instead of waiting for ever
        assert sorted(await ranked(router, [stopped], request("4", route=key, avoid=("a",)))) == ["a"]
        rr = RoundRobinRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        rr.initialize_state()
        for i in range(3):
            assert await ranked(rr, [stopped, b], request(str(i))) == ["b"]
            assert await ranked(rr, [a, b], request(str(i), avoid=("b",))) == ["a"]

    asyncio.run(run())
