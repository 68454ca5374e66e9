"""What a chat body of pre-tokenized audio codes costs the server before any model work: parse
time and peak memory by the number of codes, and the JSON value cap's refusal of a body over it.

    .venv/bin/python benchmarks/request_parse.py --quick --json /tmp/request_parse.json

Each case runs in a fresh process (so freed memory of one case cannot hide the next one's peak):
the server's own body check (``request_body._validate``: the value and object counts, then pydantic's parse, whose
codes validator builds the int32 tensor) on a body of 20 stages x N frames of codes in 0..1023.
Rows: accepted bodies under the default cap, then the same parse with the cap lifted (what the cap
saves) and the refusal at the default cap. Times are medians of the repeats; peak RSS growth is
VmHWM after minus VmRSS before (Linux), the first repeat's.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import json
import random
import statistics
import subprocess
import sys
import time

from _common import base_parser, print_table, write_json

STAGES = 20


def body(frames: int) -> bytes:
    rng = random.Random(frames)
    codes = [[rng.randrange(1024) for _ in range(frames)] for _ in range(STAGES)]
    return json.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "input_audio_codes", "input_audio_codes": {"codes": codes, "format": "mimo_rvq"}},
        {"type": "text", "text": "What is said here?"}]}]}).encode()


def one_case(frames: int, max_values: int, reps: int) -> dict:
    """Runs in the child: parse ``reps`` times, report median seconds and the first peak growth."""
    from mm_pipeline.server.errors import APIError
    from mm_pipeline.server.json_limits import JSONLimits
    from mm_pipeline.server.protocol import ChatCompletionRequest
    from mm_pipeline.server.request_body import _validate
    from mm_pipeline.server.settings import ServerSettings
    from samples.synthetic.hostile_media import measured

    raw = body(frames)

    def run():
        try:
            default = ServerSettings().json_limits
            return _validate(ChatCompletionRequest, raw, JSONLimits(default.max_bytes, max_values,
                                                                    default.max_objects)), "accepted"
        except APIError as exc:
            return None, f"{exc.status}"

    (_, outcome), _, grown_mb = measured(run)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"outcome": outcome, "seconds": statistics.median(times), "peak_mb": grown_mb,
            "body_mb": len(raw) / 2**20}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--one", nargs=3, type=int, metavar=("FRAMES", "MAX_VALUES", "REPS"), help=argparse_hidden())
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_case(*args.one)))
        return
    from mm_pipeline.server.settings import ServerSettings

    cap = ServerSettings().max_json_values
    reps = 2 if args.quick else 3
    minutes = [1, 10] if args.quick else [1, 10, 30, 60]
    over = cap // STAGES + 25_000  # frames whose values pass the cap
    cases = [(f"{m} min", m * 60 * 25, cap) for m in minutes]
    cases += [(f"{over * STAGES / 1e6:.1f} M values, cap lifted", over, 10**12),
              (f"{over * STAGES / 1e6:.1f} M values, default cap", over, cap)]
    rows, results = [], {"max_json_values": cap, "reps": reps}
    for name, frames, limit in cases:
        out = subprocess.run([sys.executable, __file__, "--one", str(frames), str(limit), str(reps)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        values = frames * STAGES
        rows.append([name, values, r["body_mb"], r["outcome"], r["seconds"] * 1e3, r["peak_mb"],
                     r["peak_mb"] * 2**20 / values])
        key = name.replace(" ", "_").replace(",", "").replace(".", "p")
        results.update({f"{key}_ms": round(r["seconds"] * 1e3, 1), f"{key}_peak_mb": round(r["peak_mb"], 1),
                        f"{key}_outcome": r["outcome"]})
    print_table(f"chat body of {STAGES}-stage audio codes: the server's body check (median of {reps}; "
                f"peak RSS growth of the first)",
                ["case", "values", "body MB", "answer", "parse ms", "peak RSS MB", "bytes/value"], rows)
    write_json(args.json, results)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS  # the child process's entry: one case


if __name__ == "__main__":
    main()
