"""What the flags of ``mmserve serve`` become, checked before the model loads: the ``ServerSettings``
and the ``Listen`` address (host, port, TLS, root path).

cli.py builds the parser and adds the ServerSettings fields named in the groups below as flags of
their own; ``server_settings`` reads them back, with the hand-written flags and the API key from the
environment. A value or a combination the server cannot use is a ``UsageError`` (exit 2) here,
rather than a failure after the model loaded. serve_command.py and the ``--ray`` path
(cluster/ray_commands.py) both start from these."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Sequence

from mm_pipeline.cli import UsageError

# ServerSettings fields that are flags under their own names (the others have the older
# hand-written flags in cli.build_parser: --served-model-name, --api-key, --files-dir, --max-upload-mb, ...)
SERVER_LIMIT_FIELDS = ("max_request_bytes", "max_json_values", "max_json_objects", "request_body_idle_s",
                       "max_completion_prompts", "max_files",
                       "max_files_total_bytes", "max_audio_upload_bytes", "responses_store_bytes")
SERVER_ANSWER_FIELDS = ("reasoning_parser", "tool_call_parser", "return_tokens_as_token_ids",  # how answers are shaped
                        "transcription_prompt", "translation_prompt")
API_KEY_ENV = "MMSERVE_API_KEY"
SERVER_LOG_FIELDS = ("log_stats_interval_s", "log_requests")
SERVER_SHUTDOWN_FIELDS = ("shutdown_timeout_s",)
SERVER_CORS_FIELDS = ("allowed_origins", "allow_credentials")
SERVER_BATCH_FIELDS = ("batch_concurrency",)
SERVER_BACKGROUND_FIELDS = ("max_background_responses",)


def server_flags(fields: Sequence[str]) -> list:
    from mm_pipeline.config_flags import config_flags
    from mm_pipeline.server.settings import ServerSettings

    return [f for f in config_flags(ServerSettings) if f.flat in fields]


def server_limit_flags() -> list:
    return server_flags(SERVER_LIMIT_FIELDS)


def listen_of(args: argparse.Namespace) -> Any:
    """Host, port, TLS and root path of ``serve`` (``Listen``), the certificate loaded: a usage error
    names a flag that cannot be used, before the model loads."""
    from mm_pipeline.server.launch.listen import Listen

    try:
        listen = Listen(args.host, args.port, args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs,
                        args.ssl_cert_reqs, args.root_path, args.enable_ssl_refresh)
        listen.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return listen


def check_request_defaults(args: argparse.Namespace, model_dir: Path) -> None:
    """Usage error, before the model loads, when the sampling defaults (the checkpoint's generation
    config, --generation-config, --override-generation-config) hold a value no request may ask for:
    every request leaving that field unset would get it."""
    from llm_core.engine.sampling.generation_config import GenerationConfigError, GenerationDefaults
    from mm_pipeline.config_flags import config_flags, config_values
    from mm_pipeline.server.completions.sampling_fields import defaults_problem

    fields = config_values(args, config_flags())
    try:
        defaults = GenerationDefaults.load(model_dir, fields.get("generation_config") or "auto",
                                           fields.get("override_generation_config"))
    except GenerationConfigError as exc:
        raise UsageError(str(exc)) from None
    if (problem := defaults_problem(defaults)) is not None:
        raise UsageError(problem)


def server_settings(args: argparse.Namespace, model_dir: Path) -> Any:
    from mm_pipeline.config_flags import config_values
    from mm_pipeline.server import ServerSettings

    check_request_defaults(args, model_dir)

    upload = int(args.max_upload_mb * (1 << 20))
    limits = {"max_files_total_bytes": max(8 << 30, upload), **config_values(args, server_limit_flags()),
              **config_values(args, server_flags(SERVER_ANSWER_FIELDS)),
              **config_values(args, server_flags(SERVER_LOG_FIELDS)),
              **config_values(args, server_flags(SERVER_CORS_FIELDS)),
              **config_values(args, server_flags(SERVER_BATCH_FIELDS)),
              **config_values(args, server_flags(SERVER_BACKGROUND_FIELDS)),
              **config_values(args, server_flags(SERVER_SHUTDOWN_FIELDS))}
    if getattr(args, "disable_log_stats", False):
        limits["log_stats_interval_s"] = 0.0
    try:
        # the key from the environment when not given as a flag: a flag's value shows in `ps` to every
        # user of the machine (vLLM reads VLLM_API_KEY the same way)
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        names = args.served_model_name or [model_dir.resolve().name]
        return ServerSettings(model_name=names[0], model_aliases=tuple(names[1:]), api_key=api_key,
                              files_dir=args.files_dir, max_upload_bytes=upload,
                              default_max_tokens=args.default_max_tokens, **limits)
    except ValueError as e:  # a combination no single flag could check (upload > total store)
        raise UsageError(str(e)) from None
