"""`mmserve serve --tensor-parallel-size 2` on CPU: two ranks over gloo answer like one process, and a
killed rank takes the server down with an error (exit 1, the rank named) instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from llm_core import LLM, SamplingParams
from mm_pipeline.server.launch.server_process import ServerProcess

DEMO_MODEL = Path(__file__).resolve().parents[3] / "samples" / "demo-model"
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 120, 140]


def _spawned_ranks(pid: int) -> list[int]:
    """Children of ``pid`` that are torch.multiprocessing spawn workers (not the resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(entry.name))
    return out


def test_tensor_parallel_server_answers_like_one_process_and_dies_with_a_rank():
    with LLM(DEMO_MODEL) as llm:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    env = {"OMP_NUM_THREADS": "1"}
    server = ServerProcess(["--model", str(DEMO_MODEL), "--device", "cpu", "--tensor-parallel-size", "2",
                            "--distributed-timeout-s", "60"], env=env).start()
    try:
        assert "parallel  2 ranks: tensor-parallel 2" in server.output
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "demo-model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        ranks = _spawned_ranks(server.proc.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode == 1, server.output
        assert "the engine stopped: tensor/expert-parallel rank 1" in server.output
    finally:
        server.stop()
