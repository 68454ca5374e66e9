"""What validating a large JSON request body costs the event loop, with the object cap
(``max_json_objects``, 65,536 by default) and without it, side by side in one run: chats of many
messages or parts at the cap, bodies far over it (valid, one bad item, a million bad items), a
prompt of source code whose braces sit inside strings (counted exactly: not objects), a string of
16M escaped quotes and 70k braces (the exact count's worst text: escapes dropped a window at a
time), and a body of base64 media.

    .venv/bin/python benchmarks/body_validation.py --json /tmp/body_validation.json
    .venv/bin/python benchmarks/body_validation.py --quick     # one repetition

Each body goes through the server's own ``request_body.parse_body`` (arriving in 1 MB pieces) while
a task on the same event loop sleeps 1 ms at a time, as the server's loop-lag metric measures it.
Per case and mode: wall seconds until the body is validated or refused, the longest event-loop lag
meanwhile, the longest garbage collection, and the outcome. Every case starts with the heap frozen,
as a started server has it (runtime/warm_start.py). Medians of ``--repeat`` runs (default 3;
--quick: 1).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import base64
import gc
import json
import os
import statistics
import time

from fastapi.exceptions import RequestValidationError

from _common import base_parser, print_table, write_json
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.json_limits import JSONLimits
from mm_pipeline.server.protocol import ChatCompletionRequest
from mm_pipeline.server.request_body import parse_body
from mm_pipeline.server.settings import ServerSettings

TEXT_MESSAGE = {"role": "user", "content": [{"type": "text", "text": "hi"}]}


def cases() -> dict[str, bytes]:
    def chat(messages: list) -> bytes:
        return json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()

    bad = [TEXT_MESSAGE] * 300_000
    bad[200_000] = {"role": "user", "content": [{"type": "text"}]}
    image = "data:image/png;base64," + base64.b64encode(os.urandom(6 << 20)).decode()
    code = "int main() { if (x) { y(); } return 0; }\n" * 200_000  # 8 MB of text, 600k braces in a string
    return {
        "32k messages (64k objects)": chat([TEXT_MESSAGE] * 32_000),
        "64k string messages": chat([{"role": "user", "content": "hi"}] * 64_000),
        "1 message, 64k parts": chat([{"role": "user", "content": [{"type": "text", "text": "hi"}] * 64_000}]),
        "8 MB of code in one message": chat([{"role": "user", "content": code}]),
        "16M escaped quotes, 70k braces in a string": chat([{"role": "user", "content": "{" * 70_000 + '"' * 16_000_000}]),
        "300k messages": chat([TEXT_MESSAGE] * 300_000),
        "300k messages, #200000 bad": chat(bad),
        "1M empty messages": chat([{}] * 1_000_000),
        "8 MB base64 image": chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                                {"type": "text", "text": "hi"}]}]),
    }


class Arriving:
    """A request whose body arrives in 1 MB pieces, as the server's receive loop hands them over."""

    def __init__(self, body: bytes) -> None:
        self.body, self.headers = body, {}

    async def stream(self):
        for start in range(0, len(self.body), 1 << 20):
            yield self.body[start:start + (1 << 20)]
            await asyncio.sleep(0)


async def validate(body: bytes, limits: JSONLimits) -> str:
    try:
        return f"ok, {len((await parse_body(Arriving(body), ChatCompletionRequest, limits)).messages)} messages"
    except RequestValidationError as exc:
        return f"422, {len(exc.errors())} errors"
    except APIError as exc:
        return f"{exc.status}, {exc.message.split(' holds ')[-1][:44]}"


def measure(body: bytes, limits: JSONLimits) -> dict[str, float | str]:
    gc.collect()
    gc.freeze()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    async def run() -> tuple[float, float, str]:
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t0 - 0.001)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        outcome = await validate(body, limits)
        wall = time.perf_counter() - t0
        done.set()
        await tick
        return wall, max(lags), outcome

    gc.callbacks.append(on_gc)
    try:
        wall, lag, outcome = asyncio.run(run())
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
    return {"wall_s": wall, "max_lag_ms": lag * 1e3, "gc_max_ms": max(pauses, default=0.0) * 1e3, "outcome": outcome}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, metavar="N", help="runs per case and mode (median)")
    args = parser.parse_args()
    reps = 1 if args.quick else max(1, args.repeat)
    default = ServerSettings().json_limits
    modes = {"no object cap": JSONLimits(default.max_bytes, default.max_values, 1 << 40),
             f"max_json_objects {default.max_objects}": default}
    rows, out = [], {"reps": reps, "max_json_objects": default.max_objects}
    for name, body in cases().items():
        for mode, limits in modes.items():
            runs = [measure(body, limits) for _ in range(reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "max_lag_ms", "gc_max_ms")}
            rows.append((name, f"{len(body) / 1e6:.1f}", mode, med["wall_s"], med["max_lag_ms"], med["gc_max_ms"],
                         runs[0]["outcome"]))
            key = f"{name}|{mode}"
            out.update({f"{key}|{k}": v for k, v in med.items()})
            out[f"{key}|outcome"] = runs[0]["outcome"]
    print_table(f"validating a request body: medians of {reps}", ["body", "MB", "mode", "wall s", "max loop lag ms",
                                                                  "longest GC ms", "outcome"], rows)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
