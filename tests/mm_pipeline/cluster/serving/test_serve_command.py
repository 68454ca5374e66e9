"""``mmserve serve --ray``'s engine config follows the replicas' resources, not the driver's machine."""

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
