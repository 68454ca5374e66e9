"""Encoder → LLM replica hand-off of embeddings: the shared encoder cache's Redis tier (what
``serve --ray --encoder-replicas`` uses) vs Ray's object store, between two Ray actors of a local
cluster (one node: the object store is shared memory there; across nodes both cross the network).

Payloads: the demo model's rows for one image (samples/media/image_000000.webp, encoded) and for a
60-frame video (30 units of 2 frames, the demo video's unit shape: 24 rows each), at the demo width
(128, float32) and at a real checkpoint's width (4096, bfloat16; same row counts). Redis path: the
producer stores each unit as the cache does (safetensors bytes, one key per unit), the consumer
reads and decodes them. Object store path: the producer ``ray.put``s each unit's tensor and returns
the refs, the consumer ``ray.get``s them. Reported: the median over ``--repeats`` of producer +
consumer call, both measured from the driver (the same two actor calls each way).

    python benchmarks/embedding_handoff.py [--quick] [--json out.json]
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import torch

from _common import base_parser, print_table, write_json


def image_rows() -> torch.Tensor:
    from _served_traces import media_part

    from mm_pipeline.cluster.serving.encoder_replica import EncoderReplica
    from mm_pipeline.prompt.messages import parse_messages
    from mm_pipeline.runtime.config import OmniEngineConfig
    from tests.support.paths import DEMO_MODEL, SAMPLE_MEDIA

    enc = EncoderReplica(str(DEMO_MODEL), OmniEngineConfig.from_kwargs(device="cpu", dtype="float32"))
    try:
        part = media_part(SAMPLE_MEDIA / "image_000000.webp")
        asyncio.run(enc.encode(part))
        prepared = asyncio.run(enc.runtime.prepare_chat(parse_messages([{"role": "user", "content": [part]}])))
        (unit,) = prepared.plans[0].units
        return enc.runtime.cache.get(unit.key)
    finally:
        enc.shutdown()


def start_redis() -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tempfile.mkdtemp()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port).ping()
            return proc, port
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    repeats = 5 if args.quick else args.repeats
    torch.set_num_threads(1)
    image = image_rows()
    video_unit = torch.randn(24, image.shape[1])
    payloads = {}
    for width, dtype, label in ((image.shape[1], torch.float32, "demo width"), (4096, torch.bfloat16, "4096 bf16")):
        img = image if width == image.shape[1] else torch.randn(image.shape[0], width).to(dtype)
        unit = video_unit if width == image.shape[1] else torch.randn(24, width).to(dtype)
        payloads[f"image ({label})"] = [img]
        payloads[f"60-frame video ({label})"] = [unit.clone() for _ in range(30)]

    from mm_pipeline.cluster.ray_runtime import RayClusterConfig, connect

    redis_proc, port = start_redis()
    os.environ["PYTHONPATH"] = _bench_bootstrap.ROOT
    ray = connect(RayClusterConfig(num_cpus=2))
    url = f"redis://127.0.0.1:{port}/0"

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, payloads: dict) -> None:
            from llm_core.storage import RedisStore

            self.payloads, self.store = payloads, RedisStore.from_url(url)

        def to_redis(self, name: str, run: int) -> int:
            from mm_pipeline.encode.encoder_cache import tensor_to_bytes

            for i, t in enumerate(self.payloads[name]):
                self.store.put(f"{name}:{run}:{i}", tensor_to_bytes(t))
            return len(self.payloads[name])

        def to_objects(self, name: str) -> list:
            return [ray.put(t) for t in self.payloads[name]]

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self) -> None:
            from llm_core.storage import RedisStore

            self.store = RedisStore.from_url(url)

        def from_redis(self, name: str, run: int, n: int) -> int:
            from mm_pipeline.encode.encoder_cache import tensor_from_bytes

            return sum(tensor_from_bytes(self.store.get(f"{name}:{run}:{i}")).numel() for i in range(n))

        def from_objects(self, refs: list) -> int:
            return sum(t.numel() for t in ray.get(refs))

    producer, consumer = Producer.remote(payloads), Consumer.remote()
    ray.get([producer.to_objects.remote("image (demo width)"), consumer.from_objects.remote([])])  # warm up
    results, rows = {}, []
    for name, tensors in payloads.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        times = {"redis": [], "object_store": []}
        for run in range(repeats + 1):  # the first run of each is a warm-up
            t0 = time.perf_counter()
            n = ray.get(producer.to_redis.remote(name, run))
            got_redis = ray.get(consumer.from_redis.remote(name, run, n))
            t1 = time.perf_counter()
            refs = ray.get(producer.to_objects.remote(name))
            got_objects = ray.get(consumer.from_objects.remote(refs))
            t2 = time.perf_counter()
            assert got_redis == got_objects == sum(t.numel() for t in tensors)
            if run:
                times["redis"].append(t1 - t0)
                times["object_store"].append(t2 - t1)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append((name, len(tensors), nbytes / 1e6, med["redis"], med["object_store"], med["redis"] / med["object_store"]))
        key = name.replace(" ", "_").replace("(", "").replace(")", "").replace("-", "_")
        results[f"handoff_{key}_bytes"] = nbytes
        results[f"handoff_{key}_redis_ms"] = med["redis"]
        results[f"handoff_{key}_object_store_ms"] = med["object_store"]
    print_table(f"Embedding hand-off between two Ray actors, one node (median of {repeats})",
                ["payload", "units", "MB", "Redis ms", "object store ms", "Redis / object store"], rows)
    ray.shutdown()
    redis_proc.terminate()
    redis_proc.wait(timeout=5)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
