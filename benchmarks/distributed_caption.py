"""Captioning on Ray Data: items/s with 1 and 2 replicas, cold vs warm Redis, per-replica timeline.

    .venv/bin/python benchmarks/distributed_caption.py --quick --json /tmp/distributed_caption.json

Runs ``mmserve caption --ray``'s pipeline (mm_pipeline/cluster/caption_dataset.py) on a local Ray
cluster of this machine (``--cpus`` Ray CPUs, replicas at ``cpus / 2`` CPUs and one torch thread
each) over distinct synthetic images, captioned by a tiny omni checkpoint:

  1 replica,  cold Redis     the baseline
  2 replicas, cold Redis     scaling on one machine (2 cores: expect well under 2x)
  2 replicas, warm Redis     the same images again into a new output: every image's encoder
                             output comes from Redis (new replicas, empty memory tiers)

Keys: ``<run>_items_per_s`` (inputs / the span from the first batch start to the last batch end,
i.e. without actor start-up), ``<run>_wall_s`` (the whole job, start-up and merge included),
``<run>_redis_hits``; the timeline table shows each replica's batches relative to the job start.
Without ``redis-server`` on PATH the runs go without Redis and the warm run is left out.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from _common import base_parser, print_table, write_json


def make_images(folder: Path, n: int, size: int) -> list[str]:
    """Distinct images (noise over a gradient, one seed each): no two share an encoder cache entry."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        rng = np.random.default_rng(i)
        base = np.linspace(0, 255, size, dtype=np.float32)[None, :, None].repeat(size, 0).repeat(3, 2)
        img = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
        path = folder / f"img_{i:04d}.png"
        Image.fromarray(img).save(path)
        paths.append(str(path))
    return paths


def start_redis(workdir: Path) -> tuple[subprocess.Popen | None, str | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def run(ray, name: str, inputs: list[str], model: Path, out: Path, replicas: int, cpus: float,
        redis_url: str | None, max_tokens: int, batch_size: int) -> dict:
    from mm_pipeline.cluster.caption_dataset import run_caption_on_ray
    from mm_pipeline.cluster.distributed_job import RayJobConfig
    from mm_pipeline.cluster.job_replica import ReplicaSpec
    from mm_pipeline.jobs.caption import CaptionConfig
    from mm_pipeline.jobs.job_output import JobOutput
    from mm_pipeline.runtime.config import OmniEngineConfig

    engine = OmniEngineConfig.from_kwargs(device="cpu", num_full_tokens=8192, redis_url=redis_url,
                                          kv_store=redis_url)
    config = RayJobConfig(replicas=replicas, cpus_per_replica=cpus, batch_size=batch_size)
    spec = ReplicaSpec(model_dir=str(model), engine_config=engine, threads=config.threads,
                       output=JobOutput(out, key="input"))
    t0 = time.time()
    summary, result = run_caption_on_ray(ray, inputs, spec, CaptionConfig(max_tokens=max_tokens), config,
                                         progress_label=name)
    wall = time.time() - t0
    spans = [(s, e) for r in result.replicas for s, e, _ in r.timeline]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    assert summary.succeeded == len(inputs), summary.lines()
    return {"name": name, "replicas": replicas, "items": summary.succeeded, "wall_s": wall, "span_s": span,
            "items_per_s": summary.succeeded / span, "redis_hits": summary.cache.get("encoder_cache_hits.redis", 0),
            "t0": t0, "per_replica": result.replicas}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--cpus", type=float, default=2.0, help="Ray CPUs of the local cluster")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    if args.quick:
        args.items, args.max_tokens = 12, 4

    from mm_pipeline.cluster.ray_runtime import RayClusterConfig, connect, shutdown
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    # the local cluster's workers inherit this environment: they import this checkout, as we do
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_bench_bootstrap.ROOT, os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_omni_checkpoint(tmp / "tiny-omni", seed=0)
        inputs = make_images(tmp / "media", args.items, 224)
        redis, url = start_redis(tmp)
        ray = connect(RayClusterConfig(num_cpus=int(args.cpus)))
        runs = []
        try:
            half = args.cpus / 2
            runs.append(run(ray, "1_replica_cold", inputs, model, tmp / "a.jsonl", 1, half, url,
                            args.max_tokens, args.batch_size))
            if redis is not None:  # cold again for the 2-replica run: nothing cached by the first
                subprocess.run([shutil.which("redis-cli") or "redis-cli", "-u", url, "FLUSHALL"],
                               check=False, capture_output=True)
            runs.append(run(ray, "2_replicas_cold", inputs, model, tmp / "b.jsonl", 2, half, url,
                            args.max_tokens, args.batch_size))
            if redis is not None:
                runs.append(run(ray, "2_replicas_warm", inputs, model, tmp / "c.jsonl", 2, half, url,
                                args.max_tokens, args.batch_size))
        finally:
            shutdown()
            if redis is not None:
                redis.terminate()

    print_table(f"distributed caption: {args.items} distinct 224x224 images, max_tokens {args.max_tokens}, "
                f"local Ray cluster of {args.cpus:g} CPUs, {os.cpu_count()} cores",
                ["run", "replicas", "items", "items/s", "span s", "wall s", "redis hits"],
                [[r["name"], r["replicas"], r["items"], r["items_per_s"], r["span_s"], r["wall_s"], r["redis_hits"]]
                 for r in runs])
    timeline = []
    for r in runs:
        for rep in r["per_replica"]:
            for s, e, n in sorted(rep.timeline):
                timeline.append([r["name"], rep.replica[:8], rep.pids and min(rep.pids), n, s - r["t0"], e - r["t0"]])
    print_table("per-replica timeline (batches; seconds from the job start)",
                ["run", "replica", "pid", "items", "start s", "end s"], timeline)
    per_replica = [[r["name"], rep.replica[:8], rep.items, rep.items_per_s, rep.busy_s,
                    rep.cache.get("encoder_cache_hits.redis", 0)] for r in runs for rep in r["per_replica"]]
    print_table("per replica", ["run", "replica", "items", "items/s busy", "busy s", "redis hits"], per_replica)
    results: dict = {"items": args.items, "max_tokens": args.max_tokens, "ray_cpus": args.cpus}
    for r in runs:
        for k in ("items_per_s", "span_s", "wall_s", "redis_hits"):
            results[f"{r['name']}_{k}"] = r[k]
    if len(runs) >= 2:
        results["scaling_2_over_1"] = runs[1]["items_per_s"] / runs[0]["items_per_s"]
    if len(runs) == 3:
        results["warm_over_cold"] = runs[2]["items_per_s"] / runs[1]["items_per_s"]
    write_json(args.json, results)


if __name__ == "__main__":
    main()
