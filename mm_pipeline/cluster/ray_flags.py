"""The ``--ray`` flags of ``mmserve caption | batch`` and their value types. Parsing them imports
no Ray: the parser is built on every run, Ray only where ``--ray`` is given (ray_commands.py)."""

from __future__ import annotations

import argparse


def ray_address(text: str) -> str:
    """``--ray``'s value: ``auto``, ``ray://host:port`` or ``host:port``; ``local`` (or ``true``,
    from a config file's ``ray: true``) and no value start a local cluster (""). A file name here is
    a positional input that slipped behind the flag."""
    import re

    if text.lower() in ("", "local", "true"):
        return ""
    if text == "auto" or re.fullmatch(r"(ray://)?[A-Za-z0-9.\-\[\]:]+:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a Ray address (auto, host:port or ray://host:port); "
                                     f"write inputs before --ray, or --ray=ADDRESS")


def _mebibytes(text: str) -> float:
    """A positive, finite number of MiB (``--read-ahead-mb``)."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of MiB")
    return value


def _seconds(text: str) -> int:
    """A whole, positive number of seconds (``--replica-start-timeout-s``; Ray Data takes whole ones)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds >= 1")
    return value


def add_ray_args(p: argparse.ArgumentParser, formats: bool) -> None:
    """The ``ray`` group of ``caption`` / ``batch`` (``formats``: caption's ``--format`` too)."""
    g = p.add_argument_group("ray", "run the job on Ray Data (pip install -e '.[ray]'); every machine needs "
                             "the model directory and the output location at the same path, and Redis (--redis-url) "
                             "reachable for the shared caches")
    g.add_argument("--ray", nargs="?", const="", default=None, type=ray_address,
                   metavar="ADDRESS", help="no address (or local): start a local Ray cluster; auto / host:port / "
                   "ray://host:port: join that cluster")
    g.add_argument("--replicas", type=int, default=1, help="captioning actors, one engine each")
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs (and torch threads) per replica")
    g.add_argument("--gpus-per-replica", type=float, default=0.0, help="Ray GPUs per replica (>0: device cuda)")
    g.add_argument("--batch-size", type=int, default=16, help="inputs per batch sent to a replica")
    g.add_argument("--read-ahead-mb", type=_mebibytes, default=None, metavar="MB",
                   help="inputs read ahead of each replica, in MiB: reads wait while the replicas are this far "
                        "behind (the job's object-store limit is replicas x this; default: "
                        + ("512, or twice --media-max-bytes when more" if formats else "64") + ")")
    g.add_argument("--replica-start-timeout-s", type=_seconds, default=600, metavar="S",
                   help="every replica must be up (its model loaded) within this many seconds, else the job "
                        "fails naming the wait (work starts only when all are up)")
    if formats:
        g.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl",
                       help="output format with --ray (the rows of the JSONL output, as Parquet)")


# Flags that only one of the two paths reads: given to the other, they were silently ignored.
# ``--format parquet`` without --ray is refused by the caption command itself (jobs/commands.py).
RAY_ONLY = {
    "caption": ("replicas", "cpus_per_replica", "gpus_per_replica", "batch_size", "read_ahead_mb",
                "replica_start_timeout_s"),
    "serve": ("llm_replicas", "encoder_replicas", "encoder_cpus", "encoder_gpus", "ingress_replicas",
              "replica_cpus", "replica_gpus", "replica_threads", "router", "router_redis_url", "match_weight"),
}
RAY_ONLY["batch"] = RAY_ONLY["caption"]
NOT_WITH_RAY = {"caption": ("concurrency",), "batch": ("concurrency",)}  # a replica takes --batch-size inputs


def misplaced_flags(args: argparse.Namespace, command: argparse.ArgumentParser) -> str | None:
    """The usage error for flags of ``command`` (its subparser) that this run would ignore: a Ray
    flag without ``--ray``, or ``--concurrency`` with it; None when there are none.  Only values
    other than the flag's default count (what the command line or a config file gave)."""
    with_ray = getattr(args, "ray", None) is not None
    dests = (NOT_WITH_RAY if with_ray else RAY_ONLY).get(args.command, ())
    given = [a.option_strings[-1] for a in command._actions
             if a.dest in dests and getattr(args, a.dest, a.default) != a.default]
    if not given:
        return None
    if with_ray:
        return (f"{', '.join(given)} applies only without --ray: a --ray job's replicas each take --batch-size "
                f"inputs at a time")
    return f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --ray (without it, nothing reads them)"


def add_serve_ray_args(p: argparse.ArgumentParser) -> None:
    """The ``ray`` group of ``serve``: Ray Serve replicas behind the app as the ingress."""
    r = p.add_argument_group("ray", "serve on Ray Serve: LLM replicas behind this app as the ingress "
                             "(mm_pipeline/cluster/serving/serve_app.py); without --ray nothing here applies")
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", type=ray_address,
                   help="run on Ray Serve; no ADDRESS starts a local cluster on this machine, an ADDRESS "
                        "(auto, host:6379, ray://host:10001) joins one started with `ray start`")
    r.add_argument("--llm-replicas", type=int, default=2, help="LLM replicas, each with its own engine")
    r.add_argument("--encoder-replicas", type=int, default=0,
                   help="encoder replicas (the encoder tier: media routed by consistent hashing of its content; "
                        "needs --redis-url or a shared --encoder-cache-dir); 0: LLM replicas encode their own")
    r.add_argument("--encoder-cpus", type=float, default=1.0, help="Ray CPUs reserved per encoder replica")
    r.add_argument("--encoder-gpus", type=float, default=None,
                   help="Ray GPUs reserved per encoder replica (default: 1 when LLM replicas use GPUs, their share "
                        "when it is under one, else 0)")
    r.add_argument("--ingress-replicas", type=int, default=1, help="replicas of the HTTP app (the ingress)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per LLM replica")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs reserved per LLM replica")
    r.add_argument("--replica-threads", type=int, default=None, help="torch threads per LLM replica")
    r.add_argument("--router", choices=("affinity", "pow2", "round_robin"), default="affinity",
                   help="LLM replica choice: prefix/media affinity (default), Ray Serve's power of two choices, "
                        "or replicas in turn")
    r.add_argument("--router-redis-url", default=None,
                   help="keep the router's prefix tree in this Redis (shared by ingress replicas, kept over "
                        "restarts; default: --redis-url when given, else in each ingress)")
    r.add_argument("--match-weight", type=float, default=1.5,
                   help="router score = (match_weight x matched prefix tokens - tokens still to compute there) / prompt tokens")
