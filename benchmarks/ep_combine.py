"""Expert-parallel combine: one all-reduce (what mmserve does) vs all-to-all dispatch + combine, over
gloo between 2 CPU ranks, at MiMo-V2.5's width (H = 4096, top-8) and decode-to-prefill token counts.

Tokens are replicated on every rank after attention (tensor-parallel o_proj all-reduce, or replicated
attention), so the two ways to run the experts of W ranks are:

    allreduce   every rank runs its experts on the tokens routed to them -> all_reduce([T, H])
    all-to-all  rank r keeps tokens [rT/W, (r+1)T/W) -> all_to_all of their (token, expert) rows to
                the experts' ranks ([T/W * k, H]) -> experts -> all_to_all back -> all_gather([T/W, H])
                to replicate the tokens again for the next attention block

Only the communication is timed (the expert math is the same rows either way). A uniform router is
assumed: each rank sends (W-1)/W of its rows away. Results feed docs/parallelism.md §3.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _common import base_parser, print_table, write_json

from llm_core.distributed.rank_group import free_port

HIDDEN, TOP_K, WORLD = 4096, 8, 2


def _time(fn, iters: int) -> float:
    fn()  # warm-up (connections, buffers)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / iters


def _rank(rank: int, port: int, tokens: list[int], iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=WORLD, rank=rank,
                            timeout=timedelta(seconds=120))
    rows = []
    for t in tokens:
        x = torch.randn(t, HIDDEN)
        share = max(1, t // WORLD)
        pairs = torch.randn(share * TOP_K, HIDDEN)
        back = torch.empty_like(pairs)
        gathered = [torch.empty(share, HIDDEN) for _ in range(WORLD)]

        def allreduce() -> None:
            dist.all_reduce(x)

        def all_to_all() -> None:
            dist.all_to_all_single(back, pairs)  # dispatch: equal splits (uniform router)
            dist.all_to_all_single(pairs, back)  # combine
            dist.all_gather(gathered, pairs[:share].contiguous())  # replicate tokens again

        rows.append((t, _time(allreduce, iters), _time(all_to_all, iters)))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    tokens = [1, 64, 1024] if args.quick else [1, 16, 64, 256, 1024, 4096]
    iters = 5 if args.quick else 20
    mp = torch.multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=_rank, args=(r, port, tokens, iters, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(60)
    table = [(t, a * 1e3, b * 1e3, b / a) for t, a, b in rows]
    print_table(f"EP combine over gloo, {WORLD} CPU ranks, H={HIDDEN}, top-{TOP_K} (ms per MoE block)",
                ["tokens", "allreduce_ms", "all_to_all_ms", "all_to_all / allreduce"], table)
    write_json(args.json, {f"t{t}_{k}": v for t, a, b, r in table
                           for k, v in (("allreduce_ms", a), ("all_to_all_ms", b), ("ratio", r))})


if __name__ == "__main__":
    main()
