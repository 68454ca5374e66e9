"""Triton kernels vs their torch references and vs the roofline, at MiMo-V2.5 shapes (docs/model.md §1.1).

    decode attention (SWA: 64 q / 8 kv heads, window 128, sinks; GA: 64 / 4, full context; one long
        context with its lengths on the device, as a CUDA-graph step has them, with and without the
        host-known bound that lets the kernel split its keys)
    prefill attention (GA and SWA, one long request, causal)
    fused MoE (hidden 4096, expert intermediate 2048, 256 experts, top-8; decode and prefill batches)
    KV store (8 kv heads x (192 + 128)), tier gather (masked) and scatter
    vision band attention (32 q / 8 kv heads, dim 64, ±64 band, sinks, 1024-token frames)

Roofline: decode attention, KV copies and MoE decode are memory-bound -> achieved GB/s against HBM
bandwidth; prefill attention, MoE prefill and band attention are compute-bound -> achieved TFLOP/s
against dense bf16 peak. Peaks default to an H200 (4.8 TB/s, 989 TFLOP/s); ``--hbm-tbps`` and
``--tflops`` override them. Bytes count what the op must move at least once (K/V of visible keys,
touched expert weights, rows copied); FLOPs count only unmasked work.

Needs CUDA. On a machine without one it says so and exits 0. ``--quick`` shrinks batches and
experts; ``--json PATH`` writes a flat record.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from _common import base_parser, print_table, write_json

from kernels import attention_ref, kv_copy_ref, moe_ref, ops
from kernels.block_fp8 import BlockFP8
from kernels.band_attention_ref import band_attention_ref

H200_HBM_TBPS = 4.8
H200_BF16_TFLOPS = 989.0
HIDDEN, MOE_INTER, HEAD_DIM, V_DIM, PAGE = 4096, 2048, 192, 128, 16


@dataclass(frozen=True)
class Result:
    name: str
    triton_ms: float
    torch_ms: float
    bytes_moved: float
    flops: float
    bound: str  # "memory" or "compute"
    max_err: float

    def achieved(self) -> float:
        """GB/s for memory-bound ops, TFLOP/s for compute-bound ones."""
        return self.bytes_moved / self.triton_ms / 1e6 if self.bound == "memory" else self.flops / self.triton_ms / 1e9


def bench(fn: Callable[[], object], quick: bool) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                         return_mode="median"))


def paged_case(batch: int, context: int, new: int, num_kv: int, window: int | None, dev, gen):
    """A batch of requests with ``context`` tokens each, ``new`` of them new, pages shuffled in the pool."""
    pages_per = math.ceil(context / PAGE)
    total_pages = batch * pages_per
    table = torch.randperm(total_pages, generator=gen).view(batch, pages_per).to(dev)
    k = torch.randn(total_pages * PAGE, num_kv, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(total_pages * PAGE, num_kv, V_DIM, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(batch * new, 64, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int64) * new
    lens = torch.full((batch,), context, dtype=torch.int64)
    sinks = torch.randn(64, generator=gen).to(dev) if window is not None else None
    return dict(q=q, k_cache=k, v_cache=v, block_table=table, query_start_loc=qsl, seq_lens=lens,
                page_size=PAGE, scale=HEAD_DIM**-0.5, window=window, sinks=sinks)


def graph_case(batch: int, context: int, dev, gen, decode_keys: int | None) -> dict:
    """A GA decode case whose lengths live on the device, as in a captured decode step."""
    case = paged_case(batch, context, 1, 4, None, dev, gen)
    case.update(query_start_loc=case["query_start_loc"].to(dev), seq_lens=case["seq_lens"].to(dev))
    return case if decode_keys is None else {**case, "decode_keys": decode_keys}


def attention_result(name: str, case: dict, quick: bool) -> Result:
    batch = case["seq_lens"].shape[0]
    context = int(case["seq_lens"][0])
    new = case["q"].shape[0] // batch
    window = case["window"]
    num_kv = case["k_cache"].shape[1]
    # keys each request must read at least once, and (query, key) pairs actually visible
    keys = context if window is None else min(context, new - 1 + window)
    pairs = sum(min(context - new + i + 1, window or 10**12) for i in range(new))
    bytes_moved = batch * (keys * num_kv * (HEAD_DIM + V_DIM) * 2 + new * 64 * (HEAD_DIM + V_DIM) * 2)
    flops = batch * pairs * 64 * 2 * (HEAD_DIM + V_DIM)
    out = ops.paged_attention(**case)
    ref_case = {k: v for k, v in case.items() if k != "decode_keys"}
    ref = attention_ref.paged_attention_ref(**ref_case)
    return Result(name, bench(lambda: ops.paged_attention(**case), quick),
                  bench(lambda: attention_ref.paged_attention_ref(**ref_case), quick), bytes_moved, flops,
                  "memory" if new == 1 else "compute", (out.float() - ref.float()).abs().max().item())


def moe_result(name: str, tokens: int, experts: int, dev, gen, quick: bool, fp8: bool = False) -> Result:
    """The fused experts; ``fp8``: weights kept in block-FP8 (128 x 128, as MiMo-V2.5 stores them)
    and read as stored, against the reference on the same weights dequantised to bf16."""
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dev, torch.bfloat16)
    w_gate_up = (torch.randn(experts, 2 * MOE_INTER, HIDDEN, generator=gen) / 64).to(dev, torch.bfloat16)
    w_down = (torch.randn(experts, HIDDEN, MOE_INTER, generator=gen) / 45).to(dev, torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen).to(dev)
    weights, ids = moe_ref.route_ref(logits, None, top_k=8)
    touched = int(torch.unique(ids).numel())
    bytes_moved = touched * 3 * HIDDEN * MOE_INTER * (1 if fp8 else 2) + tokens * HIDDEN * 4
    flops = tokens * 8 * 2 * 3 * HIDDEN * MOE_INTER
    args = (x, w_gate_up, w_down, weights, ids)
    if fp8:
        gu, dn = _quantize_per_expert(w_gate_up, 2), _quantize_per_expert(w_down, 1)
        args = (x, gu.dequantize(torch.bfloat16), dn.dequantize(torch.bfloat16), weights, ids)
    kernel_args = (x, gu, dn, weights, ids) if fp8 else args
    out, ref = ops.fused_experts(*kernel_args), moe_ref.experts_ref(*args)
    return Result(name, bench(lambda: ops.fused_experts(*kernel_args), quick),
                  bench(lambda: moe_ref.experts_ref(*args), quick),
                  bytes_moved, flops, "memory" if tokens * 8 < experts * 4 else "compute",
                  (out.float() - ref.float()).abs().max().item())


def _quantize_per_expert(w: torch.Tensor, groups: int) -> BlockFP8:
    """BlockFP8.quantize one expert at a time: the whole stack at once holds several fp32 copies of it
    (256 experts of gate/up: ~17 GB each)."""
    parts = [BlockFP8.quantize(w[e:e + 1], (128, 128), groups) for e in range(w.shape[0])]
    return BlockFP8(torch.cat([p.values for p in parts]), torch.cat([p.scale_inv for p in parts]), (128, 128), groups)


def kv_results(tokens: int, dev, gen, quick: bool) -> list[Result]:
    slots = tokens * 2
    k_cache = torch.zeros(slots, 8, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros(slots, 8, V_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(tokens, 8, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(tokens, 8, V_DIM, generator=gen).to(dev, torch.bfloat16)
    slot_map = torch.randperm(slots, generator=gen)[:tokens].to(dev)
    row_bytes = 8 * (HEAD_DIM + V_DIM) * 2
    store = Result("kv store", bench(lambda: ops.store_kv(k_cache, v_cache, slot_map, k, v), quick),
                   bench(lambda: kv_copy_ref.store_kv_ref(k_cache, v_cache, slot_map, k, v), quick),
                   2 * tokens * row_bytes, 0.0, "memory", 0.0)
    valid = (torch.rand(tokens, generator=gen) < 0.9).to(dev)
    rows = ops.gather_slots(k_cache, slot_map, valid)
    err = (rows.float() - kv_copy_ref.gather_slots_ref(k_cache, slot_map, valid).float()).abs().max().item()
    moved = 2 * int(valid.sum()) * 8 * HEAD_DIM * 2
    gather = Result("tier gather (masked)", bench(lambda: ops.gather_slots(k_cache, slot_map, valid), quick),
                    bench(lambda: kv_copy_ref.gather_slots_ref(k_cache, slot_map, valid), quick), moved, 0.0,
                    "memory", err)
    scatter = Result("tier scatter", bench(lambda: ops.scatter_slots(k_cache, slot_map, rows), quick),
                     bench(lambda: kv_copy_ref.scatter_slots_ref(k_cache, slot_map, rows), quick),
                     2 * tokens * 8 * HEAD_DIM * 2, 0.0, "memory", 0.0)
    return [store, gather, scatter]


def band_result(frames: int, dev, gen, quick: bool) -> Result:
    n, window, d = frames * 1024, 64, 64
    q = torch.randn(n, 32, d, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(n, 8, d, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(n, 8, d, generator=gen).to(dev, torch.bfloat16)
    cu = torch.arange(frames + 1, dtype=torch.int32) * 1024
    sinks = torch.randn(32, generator=gen).to(dev)
    pairs = frames * sum(min(1023, i + window) - max(0, i - window) + 1 for i in range(1024))
    kw = dict(scale=d**-0.5, window=window, sinks=sinks)
    out, ref = ops.band_attention(q, k, v, cu, **kw), band_attention_ref(q, k, v, cu, **kw)
    return Result(f"vision band x{frames} frames", bench(lambda: ops.band_attention(q, k, v, cu, **kw), quick),
                  bench(lambda: band_attention_ref(q, k, v, cu, **kw), quick), n * 32 * 3 * d * 2,
                  pairs * 32 * 2 * 2 * d, "compute", (out.float() - ref.float()).abs().max().item())


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--hbm-tbps", type=float, default=H200_HBM_TBPS, help="HBM bandwidth peak, TB/s")
    parser.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS, help="dense bf16 peak, TFLOP/s")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_roofline.py needs a CUDA GPU (the Triton kernels are only timed on GPU); skipping.")
        return 0
    dev, gen, quick = torch.device("cuda"), torch.Generator().manual_seed(0), args.quick
    batch = 16 if quick else 64
    results = [
        attention_result(f"decode SWA bs{batch} ctx4096", paged_case(batch, 4096, 1, 8, 128, dev, gen), quick),
        attention_result(f"decode GA bs{batch} ctx4096", paged_case(batch, 4096, 1, 4, None, dev, gen), quick),
        attention_result("decode GA bs1 ctx32768", paged_case(1, 32768, 1, 4, None, dev, gen), quick),
        # as a CUDA-graph decode step calls it: lengths on the device, so without a host-known bound
        # the keys are not split (what graphs did before), with one they are (decode_graphs.py)
        attention_result("decode GA bs1 ctx32768 graph, no bound", graph_case(1, 32768, dev, gen, None), quick),
        attention_result("decode GA bs1 ctx32768 graph, decode_keys", graph_case(1, 32768, dev, gen, 32768), quick),
        attention_result("prefill GA 1x2048", paged_case(1, 2048, 2048, 4, None, dev, gen), quick),
        attention_result("prefill SWA 1x2048", paged_case(1, 2048, 2048, 8, 128, dev, gen), quick),
        attention_result("extend GA 4x512 on ctx4096", paged_case(4, 4096, 512, 4, None, dev, gen), quick),
    ]
    experts = 64 if quick else 256
    results += [moe_result(f"moe decode bs{batch} E{experts}", batch, experts, dev, gen, quick),
                moe_result(f"moe prefill 4096 E{experts}", 4096, experts, dev, gen, quick),
                # --fp8-experts (the default for an FP8 checkpoint on sm_89+): half the weight bytes
                moe_result(f"moe decode bs{batch} E{experts} fp8", batch, experts, dev, gen, quick, fp8=True),
                moe_result(f"moe prefill 4096 E{experts} fp8", 4096, experts, dev, gen, quick, fp8=True)]
    results += kv_results(4096 if quick else 16384, dev, gen, quick)
    results.append(band_result(4 if quick else 16, dev, gen, quick))

    rows, record = [], {"device": torch.cuda.get_device_name(), "hbm_tbps": args.hbm_tbps, "tflops": args.tflops}
    for r in results:
        peak = args.hbm_tbps * 1e3 if r.bound == "memory" else args.tflops
        unit = "GB/s" if r.bound == "memory" else "TFLOP/s"
        rows.append([r.name, r.triton_ms, r.torch_ms, r.torch_ms / r.triton_ms, f"{r.achieved():.1f} {unit}",
                     100 * r.achieved() / peak, r.max_err])
        key = r.name.replace(" ", "_")
        record.update({f"{key}_triton_ms": r.triton_ms, f"{key}_torch_ms": r.torch_ms,
                       f"{key}_roofline_pct": 100 * r.achieved() / peak, f"{key}_max_err": r.max_err})
    print_table(f"Triton kernels on {record['device']} (bf16)",
                ["op", "triton ms", "torch ms", "speedup", "achieved", "% roofline", "max |err|"], rows)
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
