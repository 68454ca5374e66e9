"""``mmserve serve`` in one process: the listening socket bound first (a port in use is a usage
error before the model loads), the engine loaded, the app served by uvicorn until SIGINT / SIGTERM,
which drain and exit 0 after the engine shut down (``DrainingServer``). ``--ray`` hands the command
to Ray Serve (mm_pipeline/cluster/). The flags are cli.py's; the settings they become,
serve_settings.py's."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from mm_pipeline import cli
from mm_pipeline.cli import UsageError, resolve_model_dir
from mm_pipeline.runtime.startup_summary import describe_engine
from mm_pipeline.server.launch.serve_settings import listen_of, server_settings


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray is not None:
        from mm_pipeline.cluster.ray_commands import serve_on_ray  # Ray is imported only with --ray

        return serve_on_ray(args)
    import uvicorn

    from mm_pipeline.server import create_app
    from mm_pipeline.server.launch.runner import DrainingServer
    from mm_pipeline.prompt.reasoning import describe_reasoning, resolve_reasoning
    from mm_pipeline.prompt.tool_calls import describe_tool_calls, resolve_tool_calls

    model_dir = resolve_model_dir(args.model)
    settings = server_settings(args, model_dir)
    listen = listen_of(args)
    try:
        sock, listen = listen.bind()  # before the model loads: a port in use is a usage error now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        engine = cli.load_engine(args, model_dir)  # through the module: tests stand in for it
    except BaseException:
        sock.close()
        raise
    loop = engine.runtime.loop
    try:
        app = create_app(engine, settings)
        reasoning = resolve_reasoning(settings.reasoning_parser, engine.tokenizer)  # as create_app resolves it
        tool_calls = resolve_tool_calls(settings.tool_call_parser, engine.tokenizer)
        lines = describe_engine(engine, model_dir) + [
            f"reasoning {describe_reasoning(settings.reasoning_parser, reasoning)}",
            f"tools     {describe_tool_calls(settings.tool_call_parser, tool_calls)}",
            f"serving   {settings.model_name} on {listen.describe()}"
            + ("; every route but /health, /ping and the upload page needs the API key" if settings.api_key else ""),
            f"upload    page: {listen.base_url}/"]
        print("\n".join(lines), file=sys.stderr, flush=True)
        if settings.log_stats_interval_s:  # the engine lines show without -v, as vLLM's do
            logging.getLogger("mmserve.stats").setLevel(logging.INFO)
        if settings.log_requests:
            logging.getLogger("mmserve.requests").setLevel(logging.INFO)
        server = DrainingServer(uvicorn.Config(app, **listen.uvicorn_kwargs(),
                                               log_level="info" if args.verbose else "warning"),
                                settings.shutdown_timeout_s, engine.end_requests, app.state.drain)
        # A dead tensor/expert-parallel rank ends the engine (RankFailure; open requests have their
        # error already): stop the server as Ctrl-C does, then exit 1 with the reason.
        loop.on_fatal = lambda exc: setattr(server, "should_exit", True)
        # uvicorn re-raises the signal it shut down on once it is done: SIGTERM's default action would
        # kill the process there (exit 143) before the engine shuts down (a tensor-parallel rank then
        # sees rank 0 vanish), so SIGTERM raises KeyboardInterrupt as SIGINT does: both drain, exit 0
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on; uvicorn.run swallows it too
            pass
    finally:
        sock.close()  # a no-op after uvicorn closed it; not so when the app or the server failed to start
        engine.shutdown()
    if loop.fatal is not None:
        print(f"mmserve: the engine stopped: {loop.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0
