"""Prefill and decode tokens/s of our engine vs transformers ``generate``, same model, same run.

Model: a random MiMo-V2-style checkpoint (default: hidden 256, 8 layers, 16 experts top-2, head dims
32/32, window 64 -- the config of the vLLM-CPU comparison in the README), fp32, greedy.
For each batch size B: B prompts of ``--prompt`` tokens, ``--gen`` greedy tokens each, in one run;
prefill = time until all B have their first token, decode = the rest (B * (gen - 1) tokens).
transformers is timed the same way through a streamer that stamps each generated token.
Ours and transformers alternate ``--repeats`` times and the fastest run of each counts, so load
from other processes on a shared machine hurts both sides alike. ``--cpu-time`` times with the
process's CPU time instead of the wall clock: on a machine shared with other jobs that is what they
cannot inflate (both sides run in this process, on the same threads).
transformers runs eager attention over the same prompts (equal lengths: no padding).

Decode MFU = achieved decode FLOP/s (every matmul of a decode token, attention over its visible keys,
at the run's mean context) / the fp32 matmul peak measured in the same run with the same threads.
``--vllm-python PATH``: also time vLLM (CPU build, installed by you in another environment; this
project never installs it) on the same checkpoint and prompts through ``_vllm_cpu_runner.py`` under
that interpreter, as a side-by-side column; without the flag, or when that interpreter cannot import
vLLM, the column is skipped with a note.
``--compile``: also our engine with fixed-shape decode steps per batch bucket (the batch sizes given),
eager and torch.compile'd (``--compile-decode``), timed in the same alternation; the compiled
engine's start-up compile seconds and the decode tokens it needs to pay them back are reported.
Each variant runs every batch once untimed first (a new context length may compile a new graph).
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import dataclasses
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _common import base_parser, matmul_rate, print_table, write_json

from transformers.generation.streamers import BaseStreamer

from llm_core import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_core.model.loader import load_model
from llm_core.model.config import ModelConfig
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, hub_config_dict

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, v_head_dim=32, sliding_window=64,
             moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=2,
             max_position_embeddings=4096, initializer_range=0.02)


CLOCK = [time.perf_counter]  # --cpu-time: time.process_time


def decode_flops_per_token(cfg, context: float) -> float:
    """FLOPs of one decode token at ``context`` keys: projections, attention over the visible keys,
    dense MLP or the top-k experts (+ router), and the LM head."""
    flops = 2.0 * cfg.hidden_size * cfg.vocab_size
    for layer in range(cfg.num_layers):
        spec = cfg.attn_spec(layer)
        window = cfg.window_of(layer)
        keys = context if window is None else min(context, window)
        flops += 2.0 * cfg.hidden_size * (spec.q_size + spec.k_size + spec.v_size)
        flops += 2.0 * spec.num_heads * spec.v_head_dim * cfg.hidden_size
        flops += 2.0 * spec.num_heads * (spec.head_dim + spec.v_head_dim) * keys
        if cfg.mlp_kinds[layer] == "moe":
            flops += 2.0 * cfg.hidden_size * cfg.num_experts
            flops += cfg.top_k * 6.0 * cfg.hidden_size * cfg.moe_intermediate_size
        else:
            flops += 6.0 * cfg.hidden_size * cfg.intermediate_size
    return flops


def vllm_checkpoint(ckpt: Path) -> Path:
    """The same weights with the hub config spelling beside them (``<ckpt>-vllm``): vLLM's MiMo-V2
    model reads the hub fields (``hybrid_layer_pattern``, ``moe_layer_freq``, ``swa_*``, the hub's
    window of previous tokens), not transformers' ``layer_types``; the weights keep separate q/k/v
    projections, as the MiMo-V2-Flash hub checkpoint has them."""
    out = ckpt.with_name(ckpt.name + "-vllm")
    out.mkdir(exist_ok=True)
    hf_cfg = json.loads((ckpt / "config.json").read_text())
    config = ModelConfig.from_hf(hf_cfg)
    hub = hub_config_dict(config, hf_cfg, fp8_block=None)
    hub.pop("attention_projection_layout")  # fused qkv is the V2.5 layout; these weights are split
    # vLLM reads the hub's window field as visible keys, the query's own included, where the hub
    # (and transformers, sglang, we) count previous tokens (docs/model.md, the open point on the
    # window): give it our visible count so both run the same model -- with the hub's value vLLM saw
    # one key fewer and its greedy tokens left ours once prompts outgrew the window
    hub["sliding_window"] = hub["sliding_window_size"] = config.sliding_window
    hub.update(architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash")
    (out / "config.json").write_text(json.dumps(hub, indent=1))
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


def time_vllm(python: str, ckpt: Path, batches: dict[int, list[list[int]]], gen: int, threads: int,
              max_model_len: int) -> dict[int, tuple[float, float, list[list[int]]]] | None:
    """Per batch size (prefill s, decode s, tokens) from vLLM under ``python``; None (with a note)
    when that interpreter is missing or cannot run vLLM."""
    if not Path(python).exists():
        print(f"vLLM: {python} does not exist; column skipped")
        return None
    job = {"model": str(vllm_checkpoint(ckpt)), "batches": {str(b): p for b, p in batches.items()}, "gen": gen,
           "threads": threads or torch.get_num_threads(), "max_model_len": max_model_len}
    proc = subprocess.run([python, str(Path(__file__).with_name("_vllm_cpu_runner.py"))], input=json.dumps(job),
                          capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"vLLM: {python} could not run it ({tail}); column skipped")
        return None
    return {int(b): (pf, dec, toks) for b, (pf, dec, toks) in json.loads(line[len("VLLM_RESULT "):]).items()}


def fixed_shape_engines(model, cfg: EngineConfig, batches: list[int]) -> tuple[dict[str, LLM], float]:
    """Our engine with fixed-shape decode steps per bucket of ``batches``: eager and compiled, and
    the compiled one's start-up (warm-up compile) seconds."""
    fixed = LLMEngine(model, cfg)
    fixed.runner.enable_decode_graphs(fixed.pool, buckets=tuple(batches), mode="eager",
                                      max_model_len=fixed.max_model_len)
    t0 = time.perf_counter()
    compiled = LLMEngine(model, dataclasses.replace(cfg, compile_decode=True, decode_buckets=tuple(batches)))
    return {"fixed": LLM.from_engine(fixed), "compiled": LLM.from_engine(compiled)}, time.perf_counter() - t0


def prompts(batch: int, n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, n), generator=g).tolist()


def time_ours(llm: LLM, batch: list[list[int]], gen: int) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds = until every request has its first token, decode seconds = the rest, tokens)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    t0 = CLOCK[0]()
    for i, p in enumerate(batch):
        eng.add_request(f"bench-{i}", p, params)
    first: set[str] = set()
    t_first = None
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.token_ids:
                first.add(o.request_id)
            if o.finished:
                final[o.request_id] = o.token_ids
        if t_first is None and len(first) == len(batch):
            t_first = CLOCK[0]()
    t_end = CLOCK[0]()
    return t_first - t0, t_end - t_first, [final[f"bench-{i}"] for i in range(len(batch))]


class _Stamps(BaseStreamer):
    """transformers streamer that only timestamps each put(): the prompt, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(CLOCK[0]())

    def end(self) -> None:
        pass


def time_hf(hf, batch: list[list[int]], gen: int) -> tuple[float, float, list[list[int]]]:
    x = torch.tensor(batch)
    stamps = _Stamps()
    with torch.inference_mode():
        t0 = CLOCK[0]()
        out = hf.generate(x, max_new_tokens=gen, do_sample=False, streamer=stamps)
        t_end = CLOCK[0]()
    t_first = stamps.times[1]  # times[0] is the prompt
    return t_first - t0, t_end - t_first, out[:, x.shape[1]:].tolist()


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=64)
    # One intra-op thread by default: on the shared 2-core dev box a second thread mostly adds
    # contention (both engines run with the same setting; 0 = torch's default).
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with process CPU time instead of wall time (a shared, busy machine)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="python of an environment with vLLM (CPU build) installed: adds a vLLM column")
    p.add_argument("--compile", action="store_true",
                   help="also time fixed-shape decode steps per batch bucket, eager and torch.compile'd")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="our weights and KV pool on 4 KB pages (EngineConfig.huge_pages off)")
    p.add_argument("--no-native", action="store_true",
                   help="torch paths only: the C kernels (kernels/native/) off, for A/B runs")
    p.add_argument("--no-persistent-batch", action="store_true",
                   help="rebuild every decode step's inputs (EngineConfig.persistent_decode_batch off)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per batch, ours and transformers alternating; the fastest counts (shared CPUs)")
    args = p.parse_args()
    if args.quick:
        args.gen = min(args.gen, 16)
        args.prompt = min(args.prompt, 128)
        args.repeats = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK[0] = time.process_time
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = build_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="mmserve-bench-")) / "m", **MODEL)
    model = load_model(ckpt, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
    print(f"model {n_params / 1e6:.1f}M params, prompt {args.prompt}, gen {args.gen}, "
          f"threads {torch.get_num_threads()}")
    peak = matmul_rate(3)[1 if args.cpu_time else 0]  # GFLOP/s, same threads and clock, this run: MFU's denominator
    print(f"fp32 matmul peak {peak:.1f} GFLOP/s")
    flops_tok = decode_flops_per_token(model.config, args.prompt + args.gen / 2)
    max_b = max(batches)
    vllm = None
    if args.vllm_python:
        vllm = time_vllm(args.vllm_python, ckpt, {b: prompts(b, args.prompt, MODEL["vocab_size"]) for b in batches},
                         args.gen, args.threads, args.prompt + args.gen + 16)
    cfg = EngineConfig(page_size=16, num_full_tokens=max_b * (args.prompt + args.gen + 32),
                       num_swa_tokens=max_b * (64 + args.prompt + 64), max_num_seqs=max_b,
                       max_num_batched_tokens=max(2048, args.prompt * 8), native_cpu_kernels=not args.no_native,
                       huge_pages=not args.no_huge_pages, persistent_decode_batch=not args.no_persistent_batch)
    llm = LLM.from_engine(LLMEngine(model, cfg))
    time_ours(llm, prompts(1, args.prompt, MODEL["vocab_size"]), 3)  # warm up
    variants, startup_s = fixed_shape_engines(model, cfg, batches) if args.compile else ({}, 0.0)
    if hf is not None:
        time_hf(hf, prompts(1, args.prompt, MODEL["vocab_size"]), 3)
    rows, res = [], {"native_kernels": not args.no_native, "huge_pages": not args.no_huge_pages,
                     "persistent_decode_batch": not args.no_persistent_batch,
                     "prompt_tokens": args.prompt, "gen_tokens": args.gen,
                     "params_m": n_params / 1e6, "matmul_peak_gflops": peak, "decode_gflop_per_token": flops_tok / 1e9}
    for b in batches:
        batch = prompts(b, args.prompt, MODEL["vocab_size"])
        ours_runs, hf_runs = [], []
        var_runs: dict[str, list] = {name: [] for name in variants}
        for v in variants.values():
            time_ours(v, batch, args.gen)  # untimed: compiles this batch's (bucket, keys) graphs
        for _ in range(args.repeats):
            ours_runs.append(time_ours(llm, batch, args.gen))
            for name, v in variants.items():
                var_runs[name].append(time_ours(v, batch, args.gen))
            if hf is not None:
                hf_runs.append(time_hf(hf, batch, args.gen))
        pf, dec_t = min(r[0] for r in ours_runs), min(r[1] for r in ours_runs)
        toks = ours_runs[0][2]
        ours_pf, ours_dec = b * args.prompt / pf, b * (args.gen - 1) / max(dec_t, 1e-9)
        mfu = ours_dec * flops_tok / (peak * 1e9)
        res[f"ours_prefill_tok_s_b{b}"], res[f"ours_decode_tok_s_b{b}"] = ours_pf, ours_dec
        res[f"decode_mfu_b{b}"] = mfu
        row = [b, ours_pf, ours_dec, mfu]
        if hf is not None:
            hpf, hdec_t = min(r[0] for r in hf_runs), min(r[1] for r in hf_runs)
            htoks = hf_runs[0][2]
            hf_pf, hf_dec = b * args.prompt / hpf, b * (args.gen - 1) / max(hdec_t, 1e-9)
            same = sum(a == c for a, c in zip(toks, htoks))
            res.update({f"hf_prefill_tok_s_b{b}": hf_pf, f"hf_decode_tok_s_b{b}": hf_dec,
                        f"decode_ratio_vs_hf_b{b}": ours_dec / hf_dec,
                        f"prefill_ratio_vs_hf_b{b}": ours_pf / hf_pf, f"same_tokens_as_hf_b{b}": same / b})
            row += [hf_pf, hf_dec, ours_pf / hf_pf, ours_dec / hf_dec, f"{same}/{b}"]
        if variants:
            fixed, comp = (b * (args.gen - 1) / min(r[1] for r in var_runs[n]) for n in ("fixed", "compiled"))
            same_c = sum(a == c for a, c in zip(toks, var_runs["compiled"][0][2]))
            same_f = sum(a == c for a, c in zip(toks, var_runs["fixed"][0][2]))
            payback = startup_s / (1 / ours_dec - 1 / comp) if comp > ours_dec else float("inf")
            res.update({f"fixed_decode_tok_s_b{b}": fixed, f"compiled_decode_tok_s_b{b}": comp,
                        f"compiled_ratio_b{b}": comp / ours_dec, f"same_tokens_compiled_b{b}": same_c / b,
                        f"same_tokens_fixed_b{b}": same_f / b})
            if payback != float("inf"):
                res[f"compile_payback_tokens_b{b}"] = payback
            row += [fixed, comp, comp / ours_dec, f"{same_f}/{b} {same_c}/{b}",
                    "never" if payback == float("inf") else f"{payback:.0f}"]
        if vllm is not None:
            vpf_t, vdec_t, vtoks = vllm[b]
            v_pf, v_dec = b * args.prompt / vpf_t, b * (args.gen - 1) / vdec_t
            same_v = sum(a == c for a, c in zip(toks, vtoks))
            res.update({f"vllm_prefill_tok_s_b{b}": v_pf, f"vllm_decode_tok_s_b{b}": v_dec,
                        f"decode_ratio_vs_vllm_b{b}": ours_dec / v_dec, f"same_tokens_as_vllm_b{b}": same_v / b})
            row += [v_dec, ours_dec / v_dec, f"{same_v}/{b}"]
        rows.append(row)
    cols = ["batch", "ours prefill tok/s", "ours decode tok/s", "decode MFU"]
    if hf is not None:
        cols += ["hf prefill tok/s", "hf decode tok/s", "prefill x", "decode x", "same tokens"]
        res["prefill_ratio_vs_hf"] = res[f"prefill_ratio_vs_hf_b{batches[len(batches) // 2]}"]
    if variants:
        cols += ["fixed eager tok/s", "compiled tok/s", "compiled x", "same fixed/compiled", "payback tokens"]
        comp_engine = variants["compiled"].engine
        res["compile_startup_s"] = startup_s
        res["compile_total_s"] = comp_engine.runner.decode_graphs.compile_seconds
        print(f"compiled engine: start-up {startup_s:.1f} s (warm-up of buckets {batches}), compile in all "
              f"{res['compile_total_s']:.1f} s (later shapes included)")
    if vllm is not None:
        cols += ["vllm decode tok/s", "decode x vllm", "same as vllm"]
    print_table(f"throughput (fp32, greedy; {'CPU' if args.cpu_time else 'wall'} time)", cols, rows)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
