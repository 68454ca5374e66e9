"""The single-process paths of ``mmserve caption | batch`` (mm_pipeline/cli.py parses the flags and
dispatches here; ``--ray`` goes on to mm_pipeline/cluster/ray_commands.py).  What can be checked
without the model -- inputs, the output file -- is checked before it loads: a usage error then
costs no load."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from mm_pipeline import cli
from mm_pipeline.cli import UsageError, resolve_model_dir
from mm_pipeline.jobs.batch import BatchJob
from mm_pipeline.jobs.caption import CaptionConfig, CaptionJob, already_done, discover_inputs
from mm_pipeline.jobs.progress import Progress
from mm_pipeline.jobs.resume import check_output
from mm_pipeline.server.batches.validation import duplicate_custom_id


def cmd_caption(args: argparse.Namespace) -> int:
    model_dir = resolve_model_dir(args.model)
    try:
        inputs = discover_inputs(args.inputs)
        config = CaptionConfig(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                               concurrency=args.concurrency)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not inputs:
        raise UsageError("no inputs found")
    if args.ray is not None:
        from mm_pipeline.cluster.ray_commands import caption_on_ray

        return caption_on_ray(args, model_dir, inputs, config)
    if args.format != "jsonl":
        raise UsageError("--format parquet needs --ray (the single-process job appends JSONL lines)")
    out = Path(args.out)
    check_output(out)  # a directory, or a file another job writes: said before the model loads
    engine = cli.load_engine(args, model_dir)  # through the module: tests lend their engine
    try:
        job = CaptionJob(engine, config)
        done = already_done(out)
        progress = Progress(sum(p not in done for p in inputs), "caption")
        summary = asyncio.run(job.run(inputs, out, progress))
        progress.close()
    finally:
        engine.shutdown()
    for line in summary.lines():
        print(line, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    if not Path(args.input).is_file():
        raise UsageError(f"batch input {args.input} does not exist")
    # checked for --ray too: its merge would replace the input with the answers
    if Path(args.output).exists() and Path(args.output).samefile(args.input):
        raise UsageError("the output is the input file: its answers would be read as requests")
    # checked for --ray too: the output keeps one row per custom_id, so a resumed run would take the
    # second line for done (its answer lost); refused as /v1/batches validation refuses it
    if (dup := duplicate_custom_id(Path(args.input))) is not None:
        raise UsageError(f"batch input {args.input}: {dup}; each line needs its own custom_id")
    model_dir = resolve_model_dir(args.model)
    if args.ray is not None:
        from mm_pipeline.cluster.ray_commands import batch_on_ray

        return batch_on_ray(args, model_dir)
    check_output(Path(args.output))  # a directory, or a file another job writes: said before the model loads
    engine = cli.load_engine(args, model_dir)  # through the module: tests lend their engine
    try:
        job = BatchJob(engine, concurrency=args.concurrency, default_max_tokens=args.default_max_tokens,
                       reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
        summary = asyncio.run(job.run(args.input, args.output))
    finally:
        engine.shutdown()
    for line in summary.lines():
        print(line, file=sys.stderr)
    return 0
