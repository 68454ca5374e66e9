"""``mmserve serve --ray``: the engine config follows the replicas' resources, not the driver's machine;
an encoder replica reserves its own GPUs, not an LLM replica's; an encoder-tier call the ingress gives
up on is cancelled on the encoder replica too; a local cluster without Ray's token auth is warned about."""

from __future__ import annotations

import pytest

from mm_pipeline.cli import parse_args

pytest.importorskip("ray")


class _Started(Exception):
    pass


@pytest.mark.parametrize(("gpus", "device", "encoder_flags", "encoder_gpus"),
                         [("1", "cuda", [], 1.0), ("0", "cpu", [], 0.0), ("4", "cuda", ["--encoder-gpus", "0.5"], 0.5)])
def test_replica_gpus_decide_the_replicas_device(monkeypatch, gpus, device, encoder_flags, encoder_gpus):
    """From a CPU-only head node, ``--replica-gpus 1`` reserved GPUs and ran every replica on CPU
    in float32 (the device came from torch.cuda.is_available() on the driver). ``--encoder-gpus``
    sets an encoder replica's own share."""
    import mm_pipeline.cluster.ray_runtime as ray_runtime
    import mm_pipeline.cluster.serving.serve_app as serve_app
    from mm_pipeline.cluster.ray_commands import serve_on_ray

    seen = {}

    def start(model_dir, config, settings, cluster):
        seen["config"], seen["cluster"] = config, cluster
        raise _Started

    monkeypatch.setattr(ray_runtime, "connect", lambda cfg: None)
    monkeypatch.setattr(serve_app, "start", start)
    monkeypatch.setattr(serve_app, "stop", lambda cluster: None)
    args = parse_args(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379", "--replica-gpus", gpus,
                       *encoder_flags])
    with pytest.raises(_Started):
        serve_on_ray(args)
    assert seen["config"].device == device
    assert seen["cluster"].encoder_gpus == encoder_gpus
    assert seen["config"].dtype == ("bfloat16" if device == "cuda" else "float32")


def test_an_encoder_call_that_times_out_is_cancelled_on_the_encoder_replica():
    """Cancelling the ingress's wait left a call Serve had already assigned running on the
    encoder replica (holding its slot) while the LLM replica encoded the same media itself."""
    import asyncio
    from types import SimpleNamespace

    from mm_pipeline.cluster.serving.remote_engine import RemoteEngine

    class Response:  # a DeploymentResponse that never answers
        cancelled = 0

        def __await__(self):
            return asyncio.get_running_loop().create_future().__await__()

        def cancel(self):
            Response.cancelled += 1

    encoders = SimpleNamespace(encode=SimpleNamespace(remote=lambda *a, **kw: Response()))
    engine = RemoteEngine(None, None, "m", encoders=encoders, encoder_timeout_s=0.05)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    asyncio.run(engine._encode_on_tier([{"role": "user", "content": [part]}], {}))
    assert Response.cancelled == 1 and engine.encoder_failures == 1


def _deployments(app) -> dict[str, dict]:
    """Each deployment of a bound Serve app (the ingress and what it was bound with): its actor options."""
    from ray.serve.deployment import Application

    out, todo = {}, [app]
    while todo:
        bound = todo.pop()._bound_deployment
        out[bound.name] = bound.ray_actor_options
        todo += [a for a in (*bound.init_args, *bound.init_kwargs.values()) if isinstance(a, Application)]
    return out


def test_encoder_replicas_reserve_their_own_gpus(tmp_path):
    """Every encoder replica reserved ``llm_num_gpus``: 8 GPUs each behind TP-8 LLM replicas, for
    encoders that run on one device -- most of a node held idle, or a tier that never schedules."""
    from mm_pipeline.cluster.serving.serve_app import ServeClusterConfig, build_app
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.server.settings import ServerSettings

    config = OmniEngineConfig.from_kwargs(device="cpu", dtype="float32", cache_dir=str(tmp_path))
    cluster = ServeClusterConfig(llm_replicas=2, encoder_replicas=2, llm_num_gpus=8)
    options = _deployments(build_app("samples/demo-model", config, ServerSettings(), cluster))
    assert options["LLM"]["num_gpus"] == 8 and options["Encoder"]["num_gpus"] == 1
    assert "num_gpus" not in options["Ingress"]
    assert [ServeClusterConfig(llm_num_gpus=g).encoder_gpus for g in (0, 0.5, 1, 8)] == [0, 0.5, 1, 1]
    assert ServeClusterConfig(llm_num_gpus=8, encoder_num_gpus=2).encoder_gpus == 2
    with pytest.raises(ValueError, match="encoder_num_gpus"):
        ServeClusterConfig(llm_num_gpus=1, encoder_num_gpus=0)  # the encoders would look for CUDA in vain


def test_a_local_cluster_without_ray_auth_is_warned_about(monkeypatch, caplog):
    """A local cluster's Ray ports listen on all interfaces (Ray has no loopback-only setting; the
    old docstring promised one): with RAY_AUTH_MODE=disabled nothing guards them, so say so."""
    import logging
    from types import SimpleNamespace

    import mm_pipeline.cluster.ray_runtime as ray_runtime

    inits: list[dict] = []
    fake = SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: inits.append(kw))
    monkeypatch.setattr(ray_runtime, "import_ray", lambda: fake)
    for mode, warned in (("disabled", True), ("token", False)):
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=ray_runtime.__name__):
            ray_runtime.connect(ray_runtime.RayClusterConfig(num_cpus=2))
        assert any("without authentication" in r.getMessage() for r in caplog.records) == warned, mode
    # no loopback pretence: ray.init would turn 127.0.0.1 into the node's routable address anyway
    assert all("_node_ip_address" not in kw and kw["include_dashboard"] is False for kw in inits)


def test_the_ingress_checks_media_counts_before_the_encoder_tier_and_passes_the_salt():
    """With an encoder tier the media is encoded before any LLM replica sees the request: its counts
    are checked at the ingress first (a 400 before anything is encoded), and a salted request's
    units are written under its salt (else they sat unsalted in the shared cache for anyone to hit)."""
    import asyncio
    from types import SimpleNamespace

    from llm_core import SamplingParams
    from mm_pipeline.cluster.serving.remote_engine import RemoteEngine
    from mm_pipeline.errors import InvalidInputError
    from mm_pipeline.media.ingest_config import MediaLimits

    calls = []

    async def encoded():
        return None

    encoders = SimpleNamespace(encode=SimpleNamespace(remote=lambda *a, **kw: calls.append(kw) or encoded()))
    engine = RemoteEngine(None, None, "m", encoders=encoders,
                          limits=MediaLimits(max_items_per_kind='{"image": 1}'))
    image = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,AAA{c}"}} for c in "AB"]

    async def ask(parts, salt=None):
        async for _ in engine.generate([{"role": "user", "content": parts}], SamplingParams(), cache_salt=salt):
            pass

    with pytest.raises(InvalidInputError, match="2 image items, limit 1"):
        asyncio.run(ask(image))
    assert calls == []  # nothing was sent to the tier
    engine._stream = lambda *a, **kw: _empty()  # the LLM replica's part is not what this tests
    asyncio.run(ask(image[:1], salt="tenant-9f"))
    assert [c["salt"] for c in calls] == ["tenant-9f"]


async def _empty():
    return
    yield


def test_a_running_serve_with_other_http_options_is_refused(monkeypatch):
    """Serve already running keeps its proxy and ignores new options with a log line: asked for
    TLS, it would answer plain HTTP while we print https://. check_http_options refuses instead."""
    from types import SimpleNamespace

    import ray.serve.context
    from ray.serve.config import HTTPOptions

    from mm_pipeline.cluster.serving.serve_app import check_http_options

    running = HTTPOptions(host="127.0.0.1", port=8000)
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: SimpleNamespace(http_config=running))
    check_http_options({"host": "127.0.0.1", "port": 8000})
    with pytest.raises(ValueError, match="already running with other HTTP options \\(ssl_certfile, ssl_keyfile\\)"):
        check_http_options({"host": "127.0.0.1", "port": 8000, "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem"})


@pytest.mark.parametrize(("flags", "error"), [
    (["--device", "cuda", "--replica-gpus", "0"], "needs --replica-gpus > 0"),
    (["--device", "cpu", "--replica-gpus", "1"], "would not use"),
    (["--replica-gpus", "1", "--tensor-parallel-size", "2"], "need --replica-gpus 2"),
    (["--replica-gpus", "2", "--tensor-parallel-size", "2", "--device", "cuda:1"], r"cuda:0..1 inside it"),
    (["--replica-gpus", "2", "--encoder-device", "cuda:2"], "--encoder-device cuda:2 is out of a replica's GPUs"),
    (["--encoder-replicas", "1", "--encoder-gpus", "1", "--redis-url", "redis://127.0.0.1:1"], "--encoder-gpus 1"),
    (["--replica-gpus", "1", "--encoder-replicas", "1", "--encoder-device", "cuda:1", "--redis-url",
      "redis://127.0.0.1:1"], "out of a replica's GPUs"),
])
def test_devices_a_replica_cannot_have_are_refused_before_ray_starts(monkeypatch, flags, error):
    """Ray shows an actor only the GPUs it reserved, as cuda:0..N-1, and one that reserved none every
    GPU of its node, uncounted: a device past the reservation, ranks without a GPU each, GPUs
    reserved for CPU replicas, or CUDA replicas without a reservation are usage errors here, before
    any cluster starts -- not failures inside every replica that Serve keeps restarting."""
    import mm_pipeline.cluster.ray_runtime as ray_runtime
    from mm_pipeline.cli import UsageError
    from mm_pipeline.cluster.ray_commands import serve_on_ray

    def connect(cfg):
        raise AssertionError("the cluster was joined before the devices were checked")

    monkeypatch.setattr(ray_runtime, "connect", connect)
    args = parse_args(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379", *flags])
    with pytest.raises(UsageError, match=error):
        serve_on_ray(args)


def test_replica_gpu_rule_accepts_what_fits():
    from mm_pipeline.cluster.ray_runtime import check_replica_gpus

    check_replica_gpus("cuda", 1, 0.5, "--replica-gpus")  # half a GPU is cuda:0 inside the actor
    check_replica_gpus("cuda", 2, 2, "--replica-gpus", "cuda:1")  # TP 2 on both, encoders beside on the second
    check_replica_gpus("cuda:1", 1, 2, "--replica-gpus")
    check_replica_gpus("cpu", 1, 0, "--replica-gpus")
    check_replica_gpus("cpu", 1, 1, "--replica-gpus", "cuda")  # the LLM on CPU, its encoders on the GPU
    with pytest.raises(ValueError, match="--encoder-device cuda needs --replica-gpus > 0"):
        check_replica_gpus("cpu", 1, 0, "--replica-gpus", "cuda")


@pytest.mark.parametrize(("flags", "fraction"), [
    (["--replica-gpus", "0.5"], 0.25),  # two replicas on one GPU: a quarter of its free memory each
    (["--replica-gpus", "0.5", "--memory-fraction", "0.8"], 0.4),
    (["--replica-gpus", "1"], 0.5),  # a whole GPU: as given
    (["--replica-gpus", "0.5", "--kv-cache-bytes", "1GiB"], 0.5),  # an explicit size is not a fraction
])
def test_replicas_sharing_a_gpu_share_its_memory(monkeypatch, flags, fraction):
    """Replicas that reserved part of a GPU each measure its free memory -- at the same moment the
    same figure -- so the KV pools' fraction of it is scaled by the reservation (0.5 x 0.5 each
    instead of 0.5 each: all of it between two replicas, nothing left for their activations)."""
    import mm_pipeline.cluster.ray_runtime as ray_runtime
    import mm_pipeline.cluster.serving.serve_app as serve_app
    from mm_pipeline.cluster.ray_commands import serve_on_ray

    seen = {}

    def start(model_dir, config, settings, cluster):
        seen["config"] = config
        raise _Started

    monkeypatch.setattr(ray_runtime, "connect", lambda cfg: None)
    monkeypatch.setattr(serve_app, "start", start)
    monkeypatch.setattr(serve_app, "stop", lambda cluster: None)
    with pytest.raises(_Started):
        serve_on_ray(parse_args(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379", *flags]))
    assert seen["config"].engine.memory_fraction == pytest.approx(fraction)
