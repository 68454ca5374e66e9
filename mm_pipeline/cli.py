"""``mmserve``: serve | caption | batch.

    mmserve serve   --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
    mmserve caption INPUT... [--model DIR] [--prompt TEXT] [--out captions.jsonl]
    mmserve batch   -i requests.jsonl -o results.jsonl [--model DIR]

Exit status: 0 when the job ran (even if some inputs failed: they are in the output), 2 for usage
errors (missing model, no inputs), 1 for an unexpected crash.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

# The committed demo model, found from this package's location (not the working directory), so
# ``mmserve caption FILE`` works from anywhere; MODEL_ENV overrides it.
REPO_DEMO_MODEL = Path(__file__).resolve().parents[1] / "samples" / "demo-model"
MODEL_ENV = "MMSERVE_MODEL"


class UsageError(Exception):
    """A problem with the command line: message for the user, exit status 2."""


def default_model_dir() -> Path:
    """``$MMSERVE_MODEL`` when set, else the demo model next to the installed package."""
    env = os.environ.get(MODEL_ENV)
    return Path(env) if env else REPO_DEMO_MODEL


def _model_dir(arg: str | None) -> Path:
    path = Path(arg) if arg else default_model_dir()
    if not (path / "config.json").is_file():
        if arg is None:
            raise UsageError(
                f"no model given and the default model {path}/ does not exist ({MODEL_ENV} or "
                f"samples/demo-model next to the package).\n"
                f"  Pass --model DIR (a MiMo-V2.5-style checkpoint directory) or set {MODEL_ENV}, or build a "
                f"tiny test model:\n"
                f"  python -c \"from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint as b; "
                f"b('{path}')\"")
        raise UsageError(f"model directory {path} has no config.json")
    return path


def _add_engine_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, default=None, help="checkpoint directory"
                   + ("" if model_required else f" (default: ${MODEL_ENV}, else the repository's samples/demo-model/)"))
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--dtype", default=None,  # checked by OmniEngineConfig (llm_core.model.dtype.parse_dtype)
                   help="model dtype: float32, bfloat16 (bf16) or float16 (fp16); default: bfloat16 on cuda, "
                        "float32 on cpu")
    g.add_argument("--kv-tokens", type=int, default=None,
                   help="full-attention KV pool size in tokens (default: sized from the model and the KV budget; "
                        "the SWA pool is sized by its own formula either way)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV of earlier prompts (default: on; windows are kept at media and message ends)")
    g.add_argument("--prefix-checkpoint-every", type=int, default=None, metavar="N",
                   help="also keep sliding-window KV every N tokens (a multiple of the page size; 0: off; "
                        "default: every 32 pages)")
    g.add_argument("--max-queue", type=int, default=None, help="requests in flight before 429")
    g.add_argument("--decode-workers", type=int, default=None, help="media decode threads")
    g.add_argument("--max-media-mb", type=float, default=None, help="size limit of one media item")
    g.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="directory whose files file:// media URLs may read (repeatable)")
    g.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) media URLs")
    g.add_argument("--allowed-media-domain", action="append", default=[], metavar="HOST",
                   help="host (and subdomains) remote media may come from (repeatable)")
    g.add_argument("--encoder-cache-dir", default=None, help="disk tier of the encoder cache")
    g.add_argument("--redis-url", default=None, help="shared Redis tier of the encoder cache")
    g.add_argument("--no-stream-embeddings", action="store_true",
                   help="start prefill only after every media unit is encoded (default: stream units into prefill)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description="Multimodal serving: OpenAI server, "
                                     "captioning and batch jobs over one engine.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(s, model_required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 routes")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: the dir name)")
    s.add_argument("--files-dir", default=None, help="keep uploads here (default: a temp dir, removed at exit)")
    s.add_argument("--max-upload-mb", type=float, default=512.0)
    s.add_argument("--default-max-tokens", type=int, default=512)

    c = sub.add_parser("caption", help="caption media files, one JSONL line per input")
    c.add_argument("inputs", nargs="+", help="files, directories (recursive), globs, or .txt/.jsonl lists")
    _add_engine_args(c, model_required=False)
    c.add_argument("--prompt", default=None, help="default: 'Describe this image.' / video / audio")
    c.add_argument("--out", default="captions.jsonl", help="output JSONL (appended; inputs in it are skipped)")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--concurrency", type=int, default=32, help="inputs in flight (the engine batches them)")

    b = sub.add_parser("batch", help="run an OpenAI Batch input file offline")
    b.add_argument("-i", "--input", required=True, help="OpenAI Batch input JSONL")
    b.add_argument("-o", "--output", required=True, help="OpenAI Batch output JSONL (appended; resumable)")
    _add_engine_args(b, model_required=False)
    b.add_argument("--concurrency", type=int, default=32)
    b.add_argument("--default-max-tokens", type=int, default=512)
    return parser


def engine_config(args: argparse.Namespace) -> Any:
    """``OmniEngineConfig`` from the engine flags (flags left unset keep the config's defaults)."""
    from mm_pipeline.media.ingest import MediaLimits
    from mm_pipeline.runtime.config import OmniEngineConfig

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    fields: dict[str, Any] = {"device": device, "dtype": args.dtype or ("float32" if device == "cpu" else "bfloat16"),
                              "allowed_local_dirs": tuple(args.allowed_local_media_path),
                              "allow_http": args.allow_remote_media,
                              "allowed_domains": tuple(args.allowed_media_domain),
                              "stream_embeddings": not args.no_stream_embeddings}
    optional = {"num_full_tokens": args.kv_tokens, "max_num_seqs": args.max_num_seqs,
                "max_model_len": args.max_model_len, "max_queue": args.max_queue,
                "prefix_checkpoint_every": args.prefix_checkpoint_every,
                "enable_prefix_caching": args.enable_prefix_caching,
                "decode_workers": args.decode_workers, "cache_dir": args.encoder_cache_dir,
                "redis_url": args.redis_url}
    fields.update({k: v for k, v in optional.items() if v is not None})
    if args.max_media_mb is not None:
        fields["limits"] = MediaLimits(max_bytes=int(args.max_media_mb * (1 << 20)))
    if args.allow_remote_media and not args.allowed_media_domain:
        raise UsageError("--allow-remote-media needs at least one --allowed-media-domain")
    try:
        return OmniEngineConfig.from_kwargs(**fields)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_engine(args: argparse.Namespace, model_dir: Path) -> Any:
    from mm_pipeline.runtime.omni_engine import OmniEngine

    print(f"loading {model_dir} ...", file=sys.stderr, flush=True)
    return OmniEngine.from_pretrained(model_dir, engine_config(args))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def describe_engine(engine: Any, model_dir: Path) -> list[str]:
    """What a user of ``serve`` needs once the model is up: model, device, the KV pool split (tokens,
    bytes, the longest context one request can hold), prefix caching. Read before any request runs
    (sizes only; they never change)."""
    from llm_core.kvcache.prefix_cache import NoPrefixCache

    llm = engine.runtime.llm
    pool, page = llm.pool, llm.pool.page_size
    cfg = llm.config
    caching = "off"
    if not isinstance(llm.prefix_cache, NoPrefixCache):
        every = f" and every {cfg.checkpoint_every} tokens" if cfg.checkpoint_every else ""
        caching = f"on (SWA windows kept at media and message ends{every})"
    full_tokens = pool.full.num_pages * page
    return [f"model     {engine.model_name} ({model_dir})",
            f"device    {llm.device}, {str(llm.dtype).removeprefix('torch.')}",
            f"KV pools  Full {full_tokens:,} tokens ({_mib(pool.full_bytes)}), "
            f"SWA {pool.swa.num_pages * page:,} tokens ({_mib(pool.swa_bytes)}) for {cfg.max_num_seqs} "
            f"requests; pages of {page} tokens",
            f"context   {min(llm.max_model_len, full_tokens):,} tokens max per request "
            f"(model limit {llm.max_model_len:,}); prefix caching {caching}"]


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mm_pipeline.server import ServerSettings, create_app

    model_dir = _model_dir(args.model)
    settings = ServerSettings(model_name=args.served_model_name or model_dir.resolve().name, api_key=args.api_key,
                              files_dir=args.files_dir, max_upload_bytes=int(args.max_upload_mb * (1 << 20)),
                              max_files_total_bytes=max(8 << 30, int(args.max_upload_mb * (1 << 20))),
                              default_max_tokens=args.default_max_tokens)
    engine = load_engine(args, model_dir)
    try:
        app = create_app(engine, settings)
        lines = describe_engine(engine, model_dir) + [
            f"serving   {settings.model_name} on http://{args.host}:{args.port}/v1 (also /health, /metrics)",
            f"upload    page: http://{args.host}:{args.port}/"]
        print("\n".join(lines), file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                    timeout_graceful_shutdown=10)
    finally:
        engine.shutdown()
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    from mm_pipeline.jobs.caption import CaptionConfig, CaptionJob, discover_inputs
    from mm_pipeline.jobs.progress import Progress

    model_dir = _model_dir(args.model)
    try:
        inputs = discover_inputs(args.inputs)
        config = CaptionConfig(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                               concurrency=args.concurrency)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not inputs:
        raise UsageError("no inputs found")
    engine = load_engine(args, model_dir)
    try:
        job = CaptionJob(engine, config)
        out = Path(args.out)
        from mm_pipeline.jobs.caption import already_done

        todo = len([p for p in inputs if p not in already_done(out)])
        progress = Progress(todo, "caption")
        summary = asyncio.run(job.run(inputs, out, progress))
        progress.close()
    finally:
        engine.shutdown()
    for line in summary.lines():
        print(line, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from mm_pipeline.jobs.batch import BatchJob

    if not Path(args.input).is_file():
        raise UsageError(f"batch input {args.input} does not exist")
    model_dir = _model_dir(args.model)
    engine = load_engine(args, model_dir)
    try:
        job = BatchJob(engine, concurrency=args.concurrency, default_max_tokens=args.default_max_tokens)
        summary = asyncio.run(job.run(args.input, args.output))
    finally:
        engine.shutdown()
    for line in summary.lines():
        print(line, file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"serve": cmd_serve, "caption": cmd_caption, "batch": cmd_batch}
    try:
        return commands[args.command](args)
    except UsageError as exc:
        print(f"mmserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
