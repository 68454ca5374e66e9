"""Soak: N minutes of mixed valid, broken and hostile requests, with disconnects, against a real
``mmserve serve`` subprocess on 127.0.0.1 (issue 22, item 8).

Concurrent clients each pick a request kind at random (the KINDS table: what is sent and which
statuses are a correct answer), some hang up mid-answer. The server's RSS is sampled from /proc
all along. At the end the script waits for the server to report idle in ``/health`` (no request
admitted, none in the engine loop or scheduler, no media call on the decode workers, KV pages held
by nothing but the prefix cache) and sends one more normal request.

Goals (exit status 1 when one fails): 0 lost requests (no answer, or a connection error, for a
request the client did not abandon), 0 answers 5xx, every status one the kind allows, RSS peak
under ``--rss-budget-mb``, idle reached, the last request served.

    python benchmarks/soak.py [--minutes 2] [--clients 8] [--rss-budget-mb 3072] [--json out.json]
                              [--model samples/demo-model] [--kv-tokens 16384]
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import base64
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from _common import base_parser, print_table, write_json
from mm_pipeline.server.launch.runner import free_port

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
ANSWER_TIMEOUT_S = 60.0  # a request without an answer by then is lost
RESPONSE_ENDS = ("event: response.completed", "event: response.incomplete")  # a Responses stream's last event


@dataclass(frozen=True)
class Kind:
    """One kind of request: ``build(rng, model)`` -> (method, path, headers, json body or raw bytes);
    ``ok``: statuses that are a correct answer; ``hang_up``: the client leaves early."""

    name: str
    group: str  # valid | broken | hostile | disconnect
    build: Callable[[random.Random, str], tuple[str, str, dict, Any]]
    ok: frozenset[int]
    hang_up: bool = False
    stream: bool = False
    # a complete stream holds one of ``stream_ends`` and no ``stream_error`` (chat: [DONE], no error
    # object; the Responses API: its last named event, no error event -- its snapshots hold "error": null)
    stream_ends: tuple[str, ...] = ("data: [DONE]",)
    stream_error: str = '"error"'


def _chat(text: str, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def _image_url(path: Path) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(path.read_bytes()).decode()


IMAGE = ROOT / "samples" / "media" / "image_000001.png"


def _image_chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is this?"}]}],
            "max_tokens": 8}


def _junk_path(rng: random.Random) -> str:
    return "/" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=rng.randint(4, 24)))


def _kinds() -> list[Kind]:
    ok200 = frozenset({200, 429})  # valid requests may meet a full queue
    bad = frozenset({400, 429})
    image = _image_url(IMAGE)
    return [
        Kind("chat", "valid", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _chat(f"say {r.randint(0, 99)}")),
             ok200),
        Kind("chat-stream", "valid", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                   _chat("count", stream=True)), ok200, stream=True),
        Kind("completion", "valid", lambda r, m: ("POST", "/v1/completions", AUTH,
                                                  {"prompt": [5, 6, 7, r.randint(8, 50)], "max_tokens": 6}), ok200),
        Kind("image", "valid", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _image_chat(image)), ok200),
        # structured outputs: distinct schemas (compiled in the worker process, then cached)
        Kind("json-schema", "valid", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _chat(
            "pick", max_tokens=12, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "properties": {"n": {"type": "integer", "maximum": r.randint(1, 40)}}}}})), ok200),
        # the Responses API: answered, streamed as named events, in the background (the server's task
        # outlives the request: the idle check at the end waits for them); stored, byte-bounded
        Kind("responses", "valid", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                 {"input": f"say {r.randint(0, 99)}", "max_output_tokens": 8}), ok200),
        Kind("responses-stream", "valid", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                        {"input": "count", "stream": True, "max_output_tokens": 8}),
             ok200, stream=True, stream_ends=RESPONSE_ENDS, stream_error="event: error"),
        Kind("responses-background", "valid", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                            {"input": "later", "background": True,
                                                             "max_output_tokens": 8}), ok200),
        Kind("models", "valid", lambda r, m: ("GET", "/v1/models", AUTH, None), frozenset({200})),
        Kind("health", "valid", lambda r, m: ("GET", "/health", {}, None), frozenset({200})),
        Kind("bad-json", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH, b"{not json"), bad),
        Kind("no-messages", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH, {"messages": []}), bad),
        Kind("top-k-1e30", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _chat("x", top_k=1e30)), bad),
        Kind("bad-regex", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                  _chat("x", structured_outputs={"regex": "(ab" * r.randint(1, 9)})), bad),
        Kind("seed-2^63", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _chat("x", seed=2**63)), bad),
        Kind("too-long", "broken", lambda r, m: ("POST", "/v1/completions", AUTH,
                                                 {"prompt": [5] * 200_000, "max_tokens": 2}), bad),
        Kind("bad-base64", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                   _image_chat("data:image/png;base64,@@@")), bad),
        Kind("text-as-image", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH, _image_chat(
            "data:image/png;base64," + base64.b64encode(b"just some text, no image " * 4).decode())),
            frozenset({400, 415, 429})),
        Kind("nul-file-url", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                     _image_chat("file:///tmp/a%00.png")),
             frozenset({400, 403, 429})),
        Kind("responses-bad-input", "broken", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                           {"input": [{"type": "mystery", "n": r.randint(0, 9)}]}), bad),
        Kind("responses-unknown-previous", "broken", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                                  {"input": "x", "previous_response_id": "resp_nope"}),
             bad),
        Kind("unknown-model", "broken", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                      _chat("x", model="gpt-9")), frozenset({404})),
        Kind("300-prompts", "hostile", lambda r, m: ("POST", "/v1/completions", AUTH,
                                                     {"prompt": [[5, 6]] * 300, "max_tokens": 1}), bad),
        Kind("n-and-prompts", "hostile", lambda r, m: ("POST", "/v1/completions", AUTH,
                                                       {"prompt": [[5, 6]] * 16, "n": 16, "max_tokens": 1}), bad),
        Kind("random-path", "hostile", lambda r, m: ("GET", _junk_path(r), {}, None), frozenset({401})),
        Kind("v1-no-key", "hostile", lambda r, m: ("GET", "/v1" + _junk_path(r), {}, None), frozenset({401})),
        Kind("metrics-no-key", "hostile", lambda r, m: ("GET", "/metrics", {}, None), frozenset({401})),
        Kind("non-ascii-key", "hostile", lambda r, m: ("GET", "/v1/models",
                                                       {"Authorization": b"Bearer \xff\xfe"}, None), frozenset({401})),
        Kind("hang-up-stream", "disconnect", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                           _chat("long", stream=True, max_tokens=64)),
             ok200, hang_up=True, stream=True),
        Kind("hang-up-responses", "disconnect", lambda r, m: ("POST", "/v1/responses", AUTH,
                                                             {"input": "long", "stream": True, "max_output_tokens": 64}),
             ok200, hang_up=True, stream=True),
        Kind("hang-up-wait", "disconnect", lambda r, m: ("POST", "/v1/chat/completions", AUTH,
                                                         _chat("long", max_tokens=64)), ok200, hang_up=True),
    ]


@dataclass
class Tally:
    sent: Counter
    statuses: Counter  # (kind, status)
    lost: Counter
    unexpected: Counter
    server_errors: int = 0
    abandoned: int = 0


async def _one(client: httpx.AsyncClient, kind: Kind, rng: random.Random, model: str, tally: Tally) -> None:
    method, path, headers, body = kind.build(rng, model)
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kwargs["content"], kwargs["headers"] = body, {**headers, "Content-Type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    tally.sent[kind.name] += 1
    try:
        if kind.hang_up:  # leave after the first bytes of a stream, or before a non-streamed answer
            try:
                async with asyncio.timeout(rng.uniform(0.02, 0.3)):
                    async with client.stream(method, path, **kwargs) as r:
                        async for _ in r.aiter_bytes():
                            break
            except TimeoutError:
                pass
            tally.abandoned += 1
            return
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            if kind.stream:
                async with client.stream(method, path, **kwargs) as r:
                    text = (await r.aread()).decode()
                    complete = any(end in text for end in kind.stream_ends) and kind.stream_error not in text
                    if r.status_code == 200 and not complete:
                        tally.unexpected[(kind.name, "stream without its end or with an error event")] += 1
            else:
                r = await client.request(method, path, **kwargs)
    except (TimeoutError, httpx.TransportError) as exc:
        tally.lost[(kind.name, type(exc).__name__)] += 1
        return
    tally.statuses[(kind.name, r.status_code)] += 1
    if r.status_code >= 500:
        tally.server_errors += 1
    if r.status_code not in kind.ok:
        tally.unexpected[(kind.name, r.status_code)] += 1


async def _drive(base: str, model: str, minutes: float, clients: int, seed: int) -> Tally:
    kinds = _kinds()
    weights = [{"valid": 5, "broken": 2, "hostile": 2, "disconnect": 2}[k.group] for k in kinds]
    tally = Tally(Counter(), Counter(), Counter(), Counter())
    deadline = time.monotonic() + minutes * 60

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base, timeout=ANSWER_TIMEOUT_S) as client:
            while time.monotonic() < deadline:
                await _one(client, rng.choices(kinds, weights)[0], rng, model, tally)

    await asyncio.gather(*(worker(i) for i in range(clients)))
    return tally


class RSSSampler:
    """Samples a process's resident set size (VmRSS from /proc) on a thread-free asyncio task."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s, self.peak_mb, self.samples = pid, interval_s, 0.0, []

    def read_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            mb = self.read_mb()
            self.peak_mb = max(self.peak_mb, mb)
            self.samples.append(mb)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass


def idle_problems(stats: dict) -> list[str]:
    """What in a /health stats snapshot is not idle (empty when idle)."""
    problems = []
    for name in ("requests_in_flight", "engine_loop_requests", "decode_pool_admitted", "decode_pool_waiting"):
        if stats.get(name):
            problems.append(f"{name}={stats[name]}")
    llm = stats.get("llm", {})
    for name in ("running", "queue_depth"):
        if llm.get(name):
            problems.append(f"llm.{name}={llm[name]}")
    cached = llm.get("prefix_cache", {})  # pages the prefix cache keeps are not held by a request
    for pool, usage in llm.get("kv_pool", {}).items():
        held = usage.get("num_used", 0) - cached.get(f"tree_{pool}_pages", 0)
        if held > 0:
            problems.append(f"kv_pool.{pool}: {held} pages held outside the prefix cache")
    return problems


async def _wait_idle(base: str, timeout_s: float) -> tuple[bool, list[str], float]:
    t0 = time.monotonic()
    problems: list[str] = ["no answer from /health"]
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        while time.monotonic() - t0 < timeout_s:
            try:
                problems = idle_problems((await client.get("/health")).json().get("stats", {}))
            except (httpx.HTTPError, ValueError) as exc:
                problems = [f"/health: {type(exc).__name__}"]
            if not problems:
                return True, [], time.monotonic() - t0
            await asyncio.sleep(0.2)
    return False, problems, time.monotonic() - t0


def start_server(model: Path, port: int, kv_tokens: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mm_pipeline.cli", "-v", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--api-key", KEY, "--kv-tokens", str(kv_tokens), "--max-queue", "32",
           "--allowed-local-media-path", str(ROOT / "samples" / "media")]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)


async def _wait_up(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"the server did not answer /health within {timeout_s} s")


async def soak(args) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="mmserve-soak-")) / "server.log"
    proc = start_server(Path(args.model), port, args.kv_tokens, log_path)
    try:
        await _wait_up(base, proc, args.start_timeout_s)
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            model = (await client.get("/v1/models", headers=AUTH)).json()["data"][0]["id"]
        rss = RSSSampler(proc.pid)
        start_mb = rss.read_mb()
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(rss.run(stop))
        t0 = time.monotonic()
        tally = await _drive(base, model, args.minutes, args.clients, args.seed)
        elapsed = time.monotonic() - t0
        idle, problems, idle_s = await _wait_idle(base, args.idle_timeout_s)
        async with httpx.AsyncClient(base_url=base, timeout=ANSWER_TIMEOUT_S) as client:
            last = await client.post("/v1/chat/completions", headers=AUTH, json=_chat("one more"))
        stop.set()
        await sampler
        server_alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    log_text = log_path.read_text(errors="replace")
    return {"tally": tally, "elapsed_s": elapsed, "start_mb": start_mb, "peak_mb": rss.peak_mb, "idle": idle,
            "tracebacks": log_text.count("Traceback (most recent call last)"),
            "rejection_lines": log_text.count("mmserve.server"),
            "idle_problems": problems, "idle_s": idle_s, "last_status": last.status_code,
            "server_alive": server_alive, "log": str(log_path)}


def main() -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rss-budget-mb", type=float, default=3072.0, help="peak RSS of the server process")
    p.add_argument("--model", default=str(ROOT / "samples" / "demo-model"))
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--idle-timeout-s", type=float, default=30.0)
    args = p.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 0.5)
    r = asyncio.run(soak(args))
    t: Tally = r["tally"]
    answered = sum(t.statuses.values())
    by_kind = sorted(t.sent)
    print_table(f"soak: {args.minutes:g} min, {args.clients} clients, {sum(t.sent.values())} requests",
                ["kind", "sent", "statuses", "lost"],
                [[k, t.sent[k], " ".join(f"{s}x{n}" for (kk, s), n in sorted(t.statuses.items()) if kk == k) or "-",
                  sum(n for (kk, _), n in t.lost.items() if kk == k)] for k in by_kind])
    goals = {
        "lost == 0": sum(t.lost.values()) == 0,
        "5xx == 0": t.server_errors == 0,
        "every status allowed": not t.unexpected,
        f"RSS peak <= {args.rss_budget_mb:g} MB": r["peak_mb"] <= args.rss_budget_mb,
        "idle after the load": r["idle"],
        "next request served": r["last_status"] == 200 and r["server_alive"],
        "no traceback in the server log": r["tracebacks"] == 0,
    }
    print_table("goals", ["goal", "met"], [[g, "yes" if ok else "NO"] for g, ok in goals.items()])
    print(f"\nrequests answered {answered}, abandoned by the client {t.abandoned}, "
          f"{sum(t.sent.values()) / r['elapsed_s']:.1f} req/s; RSS {r['start_mb']:.0f} MB at start, "
          f"peak {r['peak_mb']:.0f} MB; idle after {r['idle_s']:.1f} s; server log {r['log']} "
          f"({r['rejection_lines']} rejection lines, {r['tracebacks']} tracebacks)")
    for (k, what), n in sorted(t.unexpected.items(), key=str):
        print(f"  unexpected: {k}: {what} x{n}")
    for (k, what), n in sorted(t.lost.items()):
        print(f"  lost: {k}: {what} x{n}")
    if r["idle_problems"]:
        print("  not idle: " + ", ".join(r["idle_problems"]))
    write_json(args.json, {
        "minutes": args.minutes, "clients": args.clients, "requests": sum(t.sent.values()), "answered": answered,
        "abandoned": t.abandoned, "lost": sum(t.lost.values()), "server_errors": t.server_errors,
        "unexpected": sum(t.unexpected.values()), "rss_start_mb": round(r["start_mb"], 1),
        "rss_peak_mb": round(r["peak_mb"], 1), "rss_budget_mb": args.rss_budget_mb, "idle": r["idle"],
        "idle_after_s": round(r["idle_s"], 2), "last_status": r["last_status"], "tracebacks": r["tracebacks"],
        **{f"goal_{g.split()[0].lower().replace('-', '_')}": ok for g, ok in goals.items()},
    })
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
