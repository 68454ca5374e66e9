"""``mmserve``: serve | caption | batch.

    mmserve serve   --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
                    [--ray [ADDRESS] --llm-replicas N --encoder-replicas M --router affinity ...]
    mmserve caption INPUT... [--model DIR] [--prompt TEXT] [--out captions.jsonl] [--ray [ADDRESS] ...]
    mmserve batch   -i requests.jsonl -o results.jsonl [--model DIR] [--ray [ADDRESS] ...]

``--ray`` runs serve on Ray Serve and caption / batch on Ray Data (mm_pipeline/cluster/); without it
Ray is never imported.

Exit status: 0 when the job ran (even if some inputs failed: they are in the output), 2 for usage
errors (missing model, no inputs), 1 for an unexpected crash.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from mm_pipeline.cluster.ray_flags import add_ray_args, add_serve_ray_args, misplaced_flags

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


def resolve_model_dir(arg: str | None) -> Path:
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


# Spellings from before the flags were generated, kept working (field -> extra option strings).
FLAG_ALIASES = {"num_full_tokens": ["--kv-tokens"], "allowed_local_dirs": ["--allowed-local-media-path"],
                "allowed_domains": ["--allowed-media-domain"], "allow_http": ["--allow-remote-media"],
                "cache_dir": ["--encoder-cache-dir"], "queue_policy": ["--scheduling-policy"],
                "log_requests": ["--enable-log-requests"], "media_max_items_per_kind": ["--limit-mm-per-prompt"],
                "shutdown_timeout_s": ["--shutdown-timeout"]}
# What the CLI does when a flag is left out, where it differs from the field's default.
FLAG_NOTES = {"device": "default: cuda when available, else cpu",
              "compile_decode": "default: on for cuda, off for cpu",
              "fp8_experts": "default: on for an FP8 checkpoint on a GPU of compute capability 8.9+",
              "dtype": "default: bfloat16 on cuda, float32 on cpu",
              "allowed_local_dirs": "default: none", "allowed_domains": "default: none"}


def mebibytes(text: str) -> float:
    """An argparse ``type`` for the sizes in MiB (--max-upload-mb, --max-media-mb): a finite number
    > 0, so the bytes they become are a size (nan and inf are floats too, but no byte count)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not 0 < value < float("inf"):  # also false for nan
        raise argparse.ArgumentTypeError(f"must be a number of MiB > 0, got {text!r}")
    return value


def _add_engine_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    """``--model``, ``--config FILE`` and one flag per config field (mm_pipeline/config_flags.py)."""
    from mm_pipeline.config_flags import add_config_file_flag, add_config_flags, config_flags

    g = p.add_argument_group("engine", "every OmniEngineConfig / EngineConfig field, named after it; "
                             "nested configs as --media-* (MediaLimits) and --video-* (VideoSamplingParams; "
                             "without any --video-* flag the checkpoint's processor_config applies)")
    g.add_argument("--model", required=model_required, default=None, help="checkpoint directory"
                   + ("" if model_required else f" (default: ${MODEL_ENV}, else the repository's samples/demo-model/)"))
    add_config_file_flag(g)
    g.add_argument("--max-media-mb", type=mebibytes, default=None,
                   help="size limit of one media item in MiB (the same as --media-max-bytes)")
    add_config_flags(g, config_flags(), FLAG_ALIASES, FLAG_NOTES)
    g.add_argument("--enforce-eager", dest="config__compile_decode", action="store_false", default=argparse.SUPPRESS,
                   help="the same as --no-compile-decode (vLLM's spelling)")
    g.add_argument("--quantization", "-q", dest="config__fp8_experts", choices=["fp8"], action=_FP8Experts,
                   default=argparse.SUPPRESS, help="fp8: the same as --fp8-experts (vLLM's spelling: the routed "
                   "experts in block-FP8; activations stay bf16)")


class _FP8Experts(argparse.Action):
    """``--quantization fp8`` sets ``fp8_experts`` (the one FP8 mode mmserve serves)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description="Multimodal serving: OpenAI server, "
                                     "captioning and batch jobs over one engine.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    # no abbreviations: with one flag per config field, a prefix would often match several
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)
    _add_engine_args(s, model_required=True)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    tls = s.add_argument_group("TLS and proxies", "HTTPS with vLLM's flags (mm_pipeline/server/launch/listen.py); "
                               "also with --ray (Ray Serve's proxy), except --ssl-cert-reqs")
    tls.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the server's private key (PEM, unencrypted)")
    tls.add_argument("--ssl-certfile", default=None, metavar="FILE", help="its certificate chain (PEM)")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA bundle client certificates must chain to")
    tls.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                     help="client certificates: 0 not asked, 1 checked when sent, 2 required (mutual TLS)")
    tls.add_argument("--enable-ssl-refresh", action="store_true",
                     help="reload the key and certificate files when they change (a renewal), without a restart")
    tls.add_argument("--root-path", default="", metavar="PATH",
                     help="path prefix a reverse proxy serves the app under (e.g. /mmserve), for its links")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but /health, "
                   "/ping and the upload page (default: the MMSERVE_API_KEY environment variable, which unlike a "
                   "flag does not show in ps)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) clients use (default: the dir name); with several, requests may name any "
                        "and answers carry the first (vLLM's)")
    s.add_argument("--files-dir", default=None, help="keep uploads here (default: a temp dir, removed at exit)")
    s.add_argument("--max-upload-mb", type=mebibytes, default=512.0,
                   help="largest file /v1/files takes, in MiB (default: 512)")
    from mm_pipeline.config_flags import field_type
    from mm_pipeline.server.settings import ServerSettings

    s.add_argument("--default-max-tokens", type=field_type(ServerSettings, "default_max_tokens"), default=None,
                   help="max_tokens of a request without one (default: the model's max_new_tokens from its "
                        "generation_config.json, else 512)")
    limits = s.add_argument_group("request limits", "what one HTTP request or the upload store may hold "
                                  "(mm_pipeline/server/settings.py); beyond them the server answers 413")
    from mm_pipeline.config_flags import add_config_flags
    from mm_pipeline.server.launch.serve_settings import (
        SERVER_ANSWER_FIELDS, SERVER_BACKGROUND_FIELDS, SERVER_BATCH_FIELDS, SERVER_CORS_FIELDS, SERVER_LOG_FIELDS,
        SERVER_SHUTDOWN_FIELDS, server_flags, server_limit_flags)

    add_config_flags(limits, server_limit_flags())
    # --reasoning-parser {auto,qwen3,none}, --tool-call-parser {auto,qwen3_coder,none}
    add_config_flags(s, server_flags(SERVER_ANSWER_FIELDS))
    add_config_flags(s, server_flags(SERVER_LOG_FIELDS), FLAG_ALIASES)  # --log-stats-interval-s, --log-requests
    add_config_flags(s, server_flags(SERVER_CORS_FIELDS), FLAG_ALIASES)  # --allowed-origins, --allow-credentials
    add_config_flags(s, server_flags(SERVER_BATCH_FIELDS))  # --batch-concurrency (/v1/batches)
    add_config_flags(s, server_flags(SERVER_BACKGROUND_FIELDS))  # --max-background-responses (/v1/responses)
    add_config_flags(s, server_flags(SERVER_SHUTDOWN_FIELDS), FLAG_ALIASES)  # --shutdown-timeout-s
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no engine lines on the log (vLLM's flag; the same as --log-stats-interval-s 0)")
    add_serve_ray_args(s)

    # the jobs' settings are checked as argparse reads them, by their config dataclasses: a bad
    # one would otherwise fail every input once the model is up, and a resumed job skip them all
    from mm_pipeline.config_flags import field_type
    from mm_pipeline.jobs.batch import BatchConfig
    from mm_pipeline.jobs.caption import CaptionConfig
    from mm_pipeline.prompt.reasoning import REASONING_PARSERS
    from mm_pipeline.prompt.tool_calls import TOOL_PARSERS

    c = sub.add_parser("caption", help="caption media files, one JSONL line per input", allow_abbrev=False)
    c.add_argument("inputs", nargs="+", help="files, directories (recursive), globs, or .txt/.jsonl lists")
    _add_engine_args(c, model_required=False)
    c.add_argument("--prompt", default=None, help="default: 'Describe this image.' / video / audio")
    c.add_argument("--out", default="captions.jsonl",
                   help="output JSONL (default: captions.jsonl here; appended: inputs in it are skipped)")
    c.add_argument("--max-tokens", type=field_type(CaptionConfig, "max_tokens"), default=64,
                   help="longest caption, in tokens (default: 64)")
    c.add_argument("--temperature", type=field_type(CaptionConfig, "temperature"), default=0.0,
                   help="sampling temperature (default: 0, greedy)")
    c.add_argument("--concurrency", type=field_type(CaptionConfig, "concurrency"), default=32,
                   help="inputs in flight (the engine batches them)")
    add_ray_args(c, formats=True)

    b = sub.add_parser("batch", help="run an OpenAI Batch input file offline", allow_abbrev=False)
    b.add_argument("-i", "--input", required=True, help="OpenAI Batch input JSONL")
    b.add_argument("-o", "--output", required=True, help="OpenAI Batch output JSONL (appended; resumable)")
    _add_engine_args(b, model_required=False)
    b.add_argument("--concurrency", type=field_type(BatchConfig, "concurrency"), default=32)
    b.add_argument("--default-max-tokens", type=field_type(BatchConfig, "default_max_tokens"), default=None,
                   help="max_tokens of a line without one (default: the model's max_new_tokens, else 512)")
    b.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                   help="chat answers' <think>...</think> in reasoning_content, as `serve --reasoning-parser`")
    b.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default="auto",
                   help="chat answers' <tool_call> blocks in tool_calls, as `serve --tool-call-parser`")
    add_ray_args(b, formats=False)
    for command in (s, c, b):  # also after the command (`mmserve serve ... -v`); SUPPRESS keeps a -v given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="info-level logs (as `mmserve -v COMMAND`)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the entries of ``--config FILE`` as flags the command line does not
    give itself (explicit flags win)."""
    from mm_pipeline.config_flags import config_file_args

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # the file is found before the command line is parsed: it may give what the command requires
    # (batch's input and output), which a first full parse would refuse as missing
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--config", default=None)
    try:
        path = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # "--config" without a file: the full parse below says so
        path = None
    at = next((i + 1 for i, tok in enumerate(argv) if tok in sub.choices), None)
    if path and at is not None:
        argv = argv[:at] + config_file_args(path, sub.choices[argv[at - 1]], argv[at:]) + argv[at:]
    args = parser.parse_args(argv)
    command = sub.choices[args.command]
    if (problem := misplaced_flags(args, command)) is not None:
        command.error(problem)  # exit 2 with the usage, as argparse's own errors
    return args


def engine_config(args: argparse.Namespace, device: str | None = None) -> Any:
    """``OmniEngineConfig`` from the engine flags (flags left unset keep the config's defaults).
    ``device``: the default when ``--device`` is not given (else: cuda when this machine has one)."""
    from mm_pipeline.config_flags import config_flags, config_values
    from mm_pipeline.runtime.config import OmniEngineConfig

    fields = config_values(args, config_flags())
    if fields.get("device") is None and device is not None:
        fields["device"] = device
    if fields.get("device") is None:
        import torch

        fields["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    fields.setdefault("dtype", "float32" if fields["device"] == "cpu" else "bfloat16")
    if getattr(args, "max_media_mb", None) is not None:  # the old spelling, in MiB; --media-max-bytes wins
        fields.setdefault("media_max_bytes", int(args.max_media_mb * (1 << 20)))
    if fields.get("allow_http") and not fields.get("allowed_domains"):
        raise UsageError("--allow-http (--allow-remote-media) needs at least one --allowed-domains")
    _check_dir(fields.get("cache_dir"), "--cache-dir (--encoder-cache-dir)")
    if "://" not in (fields.get("kv_store") or "://"):  # a directory, not a redis:// URL
        _check_dir(fields["kv_store"], "--kv-store")
    try:
        return OmniEngineConfig.from_kwargs(**fields)
    except ValueError as exc:  # a combination of fields; each value alone was checked by argparse
        raise UsageError(str(exc)) from None


def _check_dir(path: str | None, flag: str) -> None:
    """A cache directory flag names a directory, or a place one can be made (the store makes it at
    load): a file there, or under a file, is a usage error now rather than a traceback after loading."""
    if path is None:
        return
    p = Path(path).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UsageError(f"{flag} {path}: {p} is not a directory")


def load_engine(args: argparse.Namespace, model_dir: Path) -> Any:
    from llm_core.distributed.parallel_context import ParallelSplitError
    from llm_core.engine.engine_config import ContextLimitError
    from llm_core.engine.sampling.generation_config import GenerationConfigError
    from llm_core.kvcache.dual_pool import KVPoolSizeError
    from llm_core.model.config import ModelConfigError
    from llm_core.model.loader import MissingWeightsError
    from mm_pipeline.runtime.config import CheckpointMismatchError
    from mm_pipeline.runtime.omni_engine import OmniEngine

    print(f"loading {model_dir} ...", file=sys.stderr, flush=True)
    config = engine_config(args)
    try:
        return OmniEngine.from_pretrained(model_dir, config)
    # a flag this checkpoint cannot run with (--video-frame-factor); a generation config that cannot
    # be used (--generation-config naming a folder without one, the checkpoint's file with a bad value)
    except (CheckpointMismatchError, GenerationConfigError) as exc:
        raise UsageError(str(exc)) from None
    # the checkpoint the user named cannot be loaded: its config.json, its weights
    except (ModelConfigError, MissingWeightsError) as exc:
        raise UsageError(f"--model {model_dir}: {exc}") from None
    # settings known to fit this model only once its shapes are read (each named as the flag)
    except ParallelSplitError as exc:
        raise UsageError(f"--tensor-parallel-size {config.engine.tensor_parallel_size} / --expert-parallel-size "
                         f"{config.engine.expert_parallel_size} do not fit this model: {exc}") from None
    except ContextLimitError as exc:
        raise UsageError(f"--max-model-len: {exc}") from None
    except KVPoolSizeError as exc:
        raise UsageError(f"the KV pools (--kv-cache-bytes, --memory-fraction, --num-swa-tokens, --page-size) "
                         f"do not fit this model: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mm_pipeline.jobs.commands import cmd_batch, cmd_caption
    from mm_pipeline.jobs.resume import OutputFileError
    from mm_pipeline.server.launch.serve_command import cmd_serve

    commands = {"serve": cmd_serve, "caption": cmd_caption, "batch": cmd_batch}
    try:
        return commands[args.command](args)
    except (UsageError, OutputFileError) as exc:  # OutputFileError: a job's output the user named
        print(f"mmserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # ``python -m mm_pipeline.cli``: run the importable module's main, not this __main__ copy's, so
    # the commands (which import mm_pipeline.cli) raise the UsageError main catches (exit 2, not 1)
    from mm_pipeline.cli import main as _main

    sys.exit(_main())
