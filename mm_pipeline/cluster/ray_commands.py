"""The ``--ray`` paths of ``mmserve serve | caption | batch`` (mm_pipeline/cli.py parses the flags and
calls these only when ``--ray`` is given, so a plain run never imports Ray): ``serve`` as a Ray Serve
application whose ingress is our app, ``caption`` / ``batch`` as Ray Data jobs."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from mm_pipeline.cli import UsageError, engine_config, resolve_model_dir


def serve_on_ray(args: argparse.Namespace) -> int:
    """``serve --ray``: the same app as the ingress of a Ray Serve application (Ray imported here only)."""
    import time

    from mm_pipeline.cluster.ray_runtime import RayClusterConfig, check_replica_gpus, connect, share_gpu_memory
    from mm_pipeline.cluster.serving.serve_app import ServeClusterConfig, start, stop
    from mm_pipeline.server.launch.serve_settings import listen_of, server_settings

    model_dir = resolve_model_dir(args.model)
    # the replicas run where their GPUs are: the device follows --replica-gpus, not this (driver) machine
    config = engine_config(args, device="cuda" if args.replica_gpus > 0 else "cpu")
    try:
        cluster = ServeClusterConfig(
            llm_replicas=args.llm_replicas, encoder_replicas=args.encoder_replicas, encoder_num_cpus=args.encoder_cpus,
            encoder_num_gpus=args.encoder_gpus,
            ingress_replicas=args.ingress_replicas, llm_num_cpus=args.replica_cpus,
            llm_num_gpus=args.replica_gpus, torch_threads=args.replica_threads, router=args.router,
            router_redis_url=args.router_redis_url or config.redis_url, match_weight=args.match_weight,
            listen=listen_of(args))
        cluster.listen.ray_http_options()  # what Ray's proxy cannot do (--ssl-cert-reqs) fails here, before Ray starts
        # the devices as a replica will see them, before a cluster starts
        check_replica_gpus(config.device, config.engine.world_size, cluster.llm_num_gpus, "--replica-gpus",
                           config.encoder_device)
        if cluster.encoder_replicas:  # an encoder replica holds the towers alone, on one device
            check_replica_gpus(config.encoder_device or config.device, 1, cluster.encoder_gpus, "--encoder-gpus")
        config = share_gpu_memory(config, cluster.llm_num_gpus)
        if cluster.encoder_replicas and not (config.cache_dir or config.redis_url):
            raise ValueError("--encoder-replicas hands embeddings over through the encoder cache: give --redis-url, "
                             "or --encoder-cache-dir on a file system every replica sees")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # SIGTERM (a container stop) stops the deployment as Ctrl-C does: its default action would end
    # this driver at once, leaving a local cluster and its replicas behind -- or, while it starts, an
    # app deploying on a cluster it joined. Ray Serve drains each replica by its own
    # graceful_shutdown_timeout_s (--shutdown-timeout-s is the one-process server's)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ray = connect(RayClusterConfig(address=args.ray or None))
    # again: joining installs Ray's core worker's own SIGTERM handler, which logs the signal and
    # aborts the driver (exit -6) after ours ran, before the app is deleted
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"starting {cluster.llm_replicas} LLM replica(s) of {model_dir} on Ray Serve "
          f"({'local cluster' if not args.ray else args.ray}; router {cluster.router}) ...", file=sys.stderr, flush=True)
    deployed = True  # from here the app may be on the cluster, until start() says it refused to run it
    serving = False
    try:
        try:
            start(model_dir, config, server_settings(args, model_dir), cluster)
        except ValueError as exc:  # a running Serve's proxy with other HTTP options (TLS): said, not a traceback
            deployed = False  # refused before serve.run: an app of that name there is not ours to delete
            raise UsageError(str(exc)) from None
        print(f"serving   on {cluster.listen.describe()}; Ctrl-C stops",
              file=sys.stderr, flush=True)
        serving = True
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the app drains and is deleted below, then
            pass  # exit 0, as a one-process server does after its drain (an error deleting it is not 0)
    finally:  # whatever ended it, a Ctrl-C while the app deploys included: the app is deleted
        try:
            if deployed:
                stop(cluster)
        except Exception as exc:  # noqa: BLE001 - Serve never started: nothing to delete
            if serving:
                raise
            print(f"mmserve: could not delete the app {cluster.app_name!r}: {exc}", file=sys.stderr, flush=True)
        finally:
            if not args.ray:
                from ray import serve

                serve.shutdown()
                ray.shutdown()
    return 0


def job_config(args: argparse.Namespace) -> Any:
    """``RayJobConfig`` of ``caption --ray`` / ``batch --ray`` from their flags (ValueError when one
    is out of range)."""
    import math

    from mm_pipeline.cluster.distributed_job import RayJobConfig

    read_ahead = None if args.read_ahead_mb is None else math.ceil(args.read_ahead_mb * (1 << 20))
    return RayJobConfig(replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
                        gpus_per_replica=args.gpus_per_replica, batch_size=args.batch_size,
                        read_ahead_bytes=read_ahead, start_timeout_s=args.replica_start_timeout_s,
                        ray_progress=args.verbose)  # else ours is the one progress report


def _ray_job(args: argparse.Namespace, model_dir: Path, out: str, key: str, fmt: str) -> tuple[Any, Any, Any, bool]:
    """(ray, ReplicaSpec, RayJobConfig, whether this call connected) for ``--ray``: configs checked,
    then the cluster joined or started (a local one: no dashboard, every core a Ray CPU)."""
    from mm_pipeline.cluster.job_replica import ReplicaSpec
    from mm_pipeline.cluster.ray_runtime import (RayClusterConfig, check_replica_gpus, connect, import_ray,
                                                     share_gpu_memory)
    from mm_pipeline.jobs.job_output import JobOutput

    try:
        config = job_config(args)
        # --redis-url shares both caches: encoder outputs, and the KV L3 tier unless --kv-store names another
        engine = engine_config(args, device="cuda" if config.gpus_per_replica > 0 else "cpu")
        check_replica_gpus(engine.device, engine.engine.world_size, config.gpus_per_replica, "--gpus-per-replica",
                           engine.encoder_device)
        engine = share_gpu_memory(engine, config.gpus_per_replica)
        if engine.redis_url and not engine.engine.kv_store:
            engine = dataclasses.replace(engine, engine=dataclasses.replace(engine.engine, kv_store=engine.redis_url))
        # replicas on other machines resolve these paths themselves: make them absolute here
        spec = ReplicaSpec(model_dir=str(model_dir.resolve()), engine_config=engine, threads=config.threads,
                           output=JobOutput(Path(out).resolve(), key=key, format=fmt))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # the output's checks (a directory, another job's file: OutputFileError, a usage error) before a
    # cluster starts; the job holds the lock itself from its done keys to its merge
    spec.output.lock().close()
    ray = import_ray()
    # a cluster this process already joined (tests, a notebook) stays up after the job
    owned = not ray.is_initialized()
    connect(RayClusterConfig(address=args.ray or None))
    return ray, spec, config, owned


def _report(command: str, owned: bool, run: Callable[[], tuple[Any, Any]], wrote: str | None = None) -> int:
    """Run a Ray job, print its summary and merge result; 1 when an input has no row (the shards are
    kept for a re-run); leave a cluster this call started shut down either way."""
    from mm_pipeline.cluster.ray_runtime import shutdown
    from mm_pipeline.jobs.job_output import IncompleteJobError

    try:
        summary, result = run()
    except IncompleteJobError as exc:
        print(f"mmserve {command}: {exc}", file=sys.stderr)
        return 1
    finally:
        if owned:
            shutdown()
    for line in summary.lines() + result.lines():
        print(line, file=sys.stderr)
    if wrote is not None:
        print(f"wrote {wrote}", file=sys.stderr)
    return 0


def caption_on_ray(args: argparse.Namespace, model_dir: Path, inputs: list[str], caption: Any) -> int:
    from mm_pipeline.cluster.caption_dataset import run_caption_on_ray

    ray, spec, config, owned = _ray_job(args, model_dir, args.out, "input", args.format)
    return _report("caption", owned, lambda: run_caption_on_ray(ray, inputs, spec, caption, config), wrote=args.out)


def batch_on_ray(args: argparse.Namespace, model_dir: Path) -> int:
    from mm_pipeline.cluster.batch_dataset import run_batch_on_ray

    ray, spec, config, owned = _ray_job(args, model_dir, args.output, "custom_id", "jsonl")
    return _report("batch", owned,
                   lambda: run_batch_on_ray(ray, Path(args.input), spec, config, args.default_max_tokens,
                                            args.reasoning_parser, args.tool_call_parser))
