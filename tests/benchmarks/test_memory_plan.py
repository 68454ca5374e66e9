"""benchmarks/memory_plan.py: the per-GPU plan of the real MiMo-V2.5 shapes (meta device, no weights)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import REPO


def test_memory_plan_table_and_json(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_plan.py"), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "requests_128k_fp8" in run.stdout
    plan = json.loads(out.read_text())
    # one GPU cannot hold the model; 8-way TP holds 1/8 of the sharded weights (+ replicated norms, router)
    assert plan["tp1_ep1_requests_128k_bf16"] == 0 and plan["tp1_ep1_weights_fp8_gb"] > 300
    assert plan["tp1_ep1_weights_fp8_gb"] / 8 < plan["tp8_ep1_weights_fp8_gb"] < plan["tp1_ep1_weights_fp8_gb"] / 7
    # TP splits the KV heads (full: 4 heads over 8 ranks -> 1 each, replicated), EP alone does not
    assert plan["tp8_ep1_kv_per_128k_request_gb"] < plan["tp1_ep8_kv_per_128k_request_gb"] / 3
    assert plan["tp8_ep8_requests_128k_fp8"] > plan["tp1_ep8_requests_128k_fp8"] > 0
    # served with the experts kept in FP8 (the CUDA default): within 7 % of the checkpoint's bytes
    # (its qkv and dense MLPs in bf16, block factors of the experts) and about half of all-bf16
    for k in ("tp8_ep8", "tp8_ep1", "tp1_ep8"):
        assert plan[f"{k}_weights_fp8_gb"] < plan[f"{k}_weights_served_gb"] < 1.07 * plan[f"{k}_weights_fp8_gb"]
        assert plan[f"{k}_weights_served_gb"] < 0.6 * plan[f"{k}_weights_bf16_gb"]
    assert plan["tp8_ep8_requests_128k_served"] > 1.8 * plan["tp8_ep8_requests_128k_bf16"]
