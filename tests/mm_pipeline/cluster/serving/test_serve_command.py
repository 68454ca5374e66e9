"""``mmserve serve --ray``: the engine config follows the replicas' resources, not the driver's machine;
an encoder-tier call the ingress gives up on is cancelled on the encoder replica too."""

from __future__ import annotations

import pytest

from mm_pipeline.cli import parse_args

pytest.importorskip("ray")


class _Started(Exception):
    pass


@pytest.mark.parametrize(("gpus", "device"), [("1", "cuda"), ("0", "cpu")])
def test_replica_gpus_decide_the_replicas_device(monkeypatch, gpus, device):
    """From a CPU-only head node, ``--replica-gpus 1`` reserved GPUs and ran every replica on CPU
    in float32 (the device came from torch.cuda.is_available() on the driver)."""
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
    args = parse_args(["serve", "--model", "samples/demo-model", "--ray", "127.0.0.1:6379", "--replica-gpus", gpus])
    with pytest.raises(_Started):
        serve_on_ray(args)
    assert seen["config"].device == device
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
