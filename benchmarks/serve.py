"""Serving benchmark: the OpenAI server under load, and ``mmserve caption`` vs a straightforward
transformers-style loop over the same model and inputs.

Part 1 — load: the real ``openai`` client (async, streaming with usage, in its own process) against
uvicorn on 127.0.0.1, several concurrency levels, requests mixed text / image / audio / video from
generated media (samples.synthetic). TTFT = request sent -> first chunk (the server sends the first
chunk once the first token exists), TPOT = (last - first chunk) / (tokens - 1), e2e, throughput,
encoder-cache hits.

Part 2 — captions: CaptionJob (all inputs in flight, engine batching, streamed prefill) vs one item
at a time: decode -> preprocess -> encoder forward -> transformers
``MiMoV2FlashForCausalLM.generate(inputs_embeds=...)``, greedy, same prompts; pixels decoded as the
server decodes them (images shrunk while decoded, video frames scaled by swscale), so the captions
agree token for token. Reports both
throughputs, the ratio and how many captions agree. Both sides start with a cold encoder cache.

    python benchmarks/serve.py [--quick] [--json out.json] [--model DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import asyncio
import json
import multiprocessing as mp
import base64
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from _common import base_parser, print_table, write_json

MODALITIES = ("text", "image", "audio", "video")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def make_media(out: Path, seed: int, n: int) -> dict[str, list[Path]]:
    from samples.synthetic.generate import generate

    labels = generate(seed, out, images=n, videos=max(1, n // 2), audios=n, max_video_seconds=2.0)
    media: dict[str, list[Path]] = {"image": [], "video": [], "audio": []}
    for rec in labels:
        media[rec["modality"]].append(out / rec["path"])
    return media


def _part(modality: str, path: Path) -> dict:
    b64 = base64.b64encode(path.read_bytes()).decode()
    if modality == "audio":
        return {"type": "input_audio", "input_audio": {"data": b64, "format": path.suffix.lstrip(".")}}
    key = "image_url" if modality == "image" else "video_url"
    return {"type": key, key: {"url": f"data:application/octet-stream;base64,{b64}"}}


def build_requests(media: dict[str, list[Path]], n: int) -> list[tuple[str, list[dict]]]:
    reqs = []
    for i in range(n):
        modality = MODALITIES[i % len(MODALITIES)]
        prompt = {"type": "text", "text": f"Describe this {modality if modality != 'text' else 'idea'} ({i})."}
        if modality == "text":
            reqs.append((modality, [{"role": "user", "content": [prompt]}]))
        else:
            items = media[modality]
            reqs.append((modality, [{"role": "user", "content": [_part(modality, items[i % len(items)]), prompt]}]))
    return reqs


async def run_level(base_url: str, model: str, requests: list, concurrency: int, max_tokens: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="-", max_retries=0, timeout=600)
    ttft, tpot, e2e, tokens, errors = [], [], [], 0, 0
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def worker() -> None:
        nonlocal tokens, errors
        while not queue.empty():
            _, messages = queue.get_nowait()
            t0 = time.perf_counter()
            first = last = None
            usage = None
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices:
                        first = first or now
                        last = now
                    if chunk.usage is not None:
                        usage = chunk.usage
            except Exception:
                errors += 1
                continue
            end = time.perf_counter()
            n = usage.completion_tokens if usage else 0
            tokens += n
            e2e.append(end - t0)
            if first is not None:
                ttft.append(first - t0)
                if n > 1:
                    tpot.append((last - first) / (n - 1))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"requests": len(requests), "errors": errors, "wall_s": wall, "req_per_s": len(e2e) / wall,
            "out_tok_per_s": tokens / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
            "e2e_p50_ms": 1e3 * pct(e2e, 50), "e2e_p99_ms": 1e3 * pct(e2e, 99)}


def client_level(base_url: str, model: str, requests: list, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """``run_level`` in its own process: the client's JSON and SSE work must not compete with the
    server for the GIL, or the server's latencies and event-loop lag would include it."""
    return asyncio.run(run_level(base_url, model, requests, concurrency, max_tokens))


def encoder_hits(engine) -> int:
    return sum(engine.stats().encoder_cache_hits.values())


# ---- part 2: captions vs a transformers-style loop --------------------------------------------------
class HFStyleCaptioner:
    """One item at a time, the way a notebook does it: decode -> preprocess -> encoder forward ->
    prompt with placeholders -> transformers ``generate(inputs_embeds=...)`` (greedy).  It reuses the
    engine's own decoders, preprocessing, towers and prompt layout, so only the serving differs."""

    def __init__(self, engine, hf_dir: Path, device: str) -> None:
        import torch
        import transformers

        rt = engine.runtime
        self.model, self.torch = rt.model, torch
        self.pre = rt.pre
        self.limits = rt.planner.config.limits
        self.sampling = rt.planner.config.video_sampling
        self.eos = list(rt.llm.model_config.eos_token_ids)
        self.hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()

    def _units(self, item) -> tuple[list, tuple[float, ...]]:
        from mm_pipeline.media.decode.audio import decode_audio
        from mm_pipeline.media.decode.image import decode_image, probe_image
        from mm_pipeline.media.decode.video import decode_range, probe_video
        from mm_pipeline.media.decode.video_sampling import sample_frames

        m = self.model
        if item.kind.value == "image":  # pixels as the server gets them: shrunk while decoded (decode_image)
            size = self.pre.image_size(*probe_image(item, self.limits))
            vis = self.pre.image(decode_image(item, self.limits, target=self.pre.image_size), size)
            return m.vision.encode_items([(vis.rows, vis.grid)]), ()
        if item.kind.value == "audio":
            segs = self.pre.audio_segments(decode_audio(item, m.audio_config.sampling_rate, self.limits))
            return m.audio.encode_segments(segs), ()
        info = probe_video(item, self.limits)
        s = sample_frames(info.total_frames, info.video_fps, self.sampling)
        targets = sorted(set(s.indices))
        size = self.pre.video_size(info.height, info.width, s.num_frames)  # frames scaled as decoded, as served
        frames = decode_range(item, info, targets, size=size)[[targets.index(i) for i in s.indices]]
        groups = self.pre.video_groups(frames, size)
        tp = self.pre.image_config.temporal_patch_size
        return m.vision.encode_items([(g.rows, g.grid) for g in groups]), tuple(s.timestamps[::tp])

    def caption(self, path: Path, prompt: str | None, max_tokens: int) -> str:
        from types import SimpleNamespace

        from mm_pipeline.jobs.caption import DEFAULT_PROMPTS
        from mm_pipeline.prompt.messages import parse_messages
        from mm_pipeline.media.ingest import IngestConfig, MediaIngestor
        from mm_pipeline.media.types import MediaSource
        from mm_pipeline.prompt.layout import MediaSlots

        torch = self.torch
        with torch.inference_mode():
            item = MediaIngestor(IngestConfig()).ingest_local(MediaSource(data=path.read_bytes()))
            rows, stamps = self._units(item)
            plan = SimpleNamespace(slots=MediaSlots(item.kind.value, tuple(int(r.shape[0]) for r in rows), stamps))
            chat = parse_messages([{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}},
                                                                {"type": "text", "text": prompt or DEFAULT_PROMPTS[item.kind]}]}])
            laid = self.model.layout.render(chat, [plan])
            ids, spans = list(laid.token_ids), laid.unit_spans
            dev = self.hf.device
            emb = self.hf.get_input_embeddings()(torch.tensor(ids, device=dev)).clone()
            for (start, end), r in zip(spans[0], rows):
                emb[start:end] = r.to(dev, emb.dtype)
            out = self.hf.generate(inputs_embeds=emb[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                   device=dev), max_new_tokens=max_tokens, do_sample=False, eos_token_id=self.eos,
                                   pad_token_id=self.eos[0])
        return self.model.tokenizer.decode(out[0].tolist(), skip_special_tokens=True).strip()


def caption_comparison(engine, hf_dir: Path, inputs: list[Path], max_tokens: int, device: str, tmp: Path) -> dict:
    from mm_pipeline.jobs.caption import CaptionConfig, CaptionJob

    job = CaptionJob(engine, CaptionConfig(max_tokens=max_tokens, concurrency=len(inputs)))
    summary = asyncio.run(job.run([str(p) for p in inputs], tmp / "captions.jsonl"))
    ours = {json.loads(ln)["input"]: json.loads(ln) for ln in (tmp / "captions.jsonl").read_text().splitlines()}
    hf = HFStyleCaptioner(engine, hf_dir, device)
    hf.caption(inputs[0], None, 2)  # warm-up (lazy init in torch / transformers), not timed
    t0 = time.perf_counter()
    theirs = {str(p): hf.caption(p, None, max_tokens) for p in inputs}
    hf_s = time.perf_counter() - t0
    same = sum(ours[k]["caption"] == v for k, v in theirs.items())

    return {"caption_items": len(inputs), "caption_failed": summary.failed, "caption_s": summary.elapsed_s,
            "caption_items_per_s": summary.items_per_s, "hf_caption_s": hf_s,
            "hf_items_per_s": len(inputs) / hf_s, "caption_throughput_ratio_vs_hf": hf_s / summary.elapsed_s,
            "captions_identical": same}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--levels", default=None, help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=None)
    args = p.parse_args()

    from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint, tiny_special_tokens
    from mm_pipeline.runtime.omni_engine import OmniEngine
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.server import ServerSettings, ServerThread, create_app
    from mm_pipeline.server.metrics import histogram_quantile

    levels = [int(x) for x in args.levels.split(",")] if args.levels else ([1, 8] if args.quick else [1, 4, 16, 32])
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    caption_tokens = args.max_tokens or 32  # the caption comparison is the same in --quick
    t_start = time.perf_counter()
    results: dict[str, Any] = {"device": args.device, "max_tokens": max_tokens}
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-") as tmp_s:
        tmp = Path(tmp_s)
        model_dir = build_tiny_omni_checkpoint(tmp / "tiny-omni", seed=0)
        sp = tiny_special_tokens()  # the HF-layout twin of the text weights (same seed, same overrides)
        hf_dir = build_tiny_hf_checkpoint(tmp / "hf", seed=0, eos_token_id=sp.im_end, pad_token_id=sp.pad,
                                          bos_token_id=None)
        load_media = make_media(tmp / "load-media", seed=1, n=4 if args.quick else 8)
        cap_media = make_media(tmp / "caption-media", seed=2, n=12)
        config = OmniEngineConfig.from_kwargs(device=args.device, num_full_tokens=32768, num_swa_tokens=16384, max_num_seqs=64)

        engine = OmniEngine.from_pretrained(model_dir, config)
        rows = []
        try:
            app = create_app(engine, ServerSettings(files_dir=str(tmp / "files")))
            with ServerThread(app) as server, ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as client:
                for c in levels:
                    reqs = build_requests(load_media, max(2 * c, 8))
                    hits0 = encoder_hits(engine)
                    app.state.metrics.lag_monitor.max_lag_s = 0.0  # measure the load only, per level
                    r = client.submit(client_level, server.base_url, engine.model_name, reqs, c, max_tokens).result()
                    r["event_loop_lag_max_ms"] = 1e3 * app.state.metrics.lag_monitor.max_lag_s
                    r["encoder_cache_hits"] = encoder_hits(engine) - hits0
                    rows.append([c, r["requests"], r["errors"], r["req_per_s"], r["out_tok_per_s"], r["ttft_p50_ms"],
                                 r["ttft_p99_ms"], r["tpot_p50_ms"], r["e2e_p50_ms"], r["e2e_p99_ms"],
                                 r["encoder_cache_hits"], r["event_loop_lag_max_ms"]])
                    results.update({f"c{c}_{k}": v for k, v in r.items()})
                results["event_loop_lag_p99_bucket_ms"] = 1e3 * histogram_quantile(app.state.metrics.loop_lag, 0.99)
        finally:
            engine.shutdown()
        top = levels[-1]
        results.update({k: results[f"c{top}_{k}"] for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms",
                                                             "e2e_p99_ms", "req_per_s", "out_tok_per_s",
                                                             "event_loop_lag_max_ms")})
        print_table(f"OpenAI server, mixed text/image/audio/video, {max_tokens} tokens each (tiny model, {args.device})",
                    ["conc", "reqs", "err", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                     "e2e p50 ms", "e2e p99 ms", "enc hits", "loop lag max ms"], rows)
        print(f"server event-loop lag over the whole load: p99 <= {results['event_loop_lag_p99_bucket_ms']:.0f} ms "
              f"(histogram bucket bound)")

        engine = OmniEngine.from_pretrained(model_dir, config)  # cold encoder cache for the caption run
        try:
            inputs = [q for paths in cap_media.values() for q in paths]
            cap = caption_comparison(engine, hf_dir, inputs, caption_tokens, args.device, tmp)
        finally:
            engine.shutdown()
        results.update(cap)
        print_table(f"captions: {cap['caption_items']} items, {caption_tokens} tokens, greedy",
                    ["pipeline", "seconds", "items/s"],
                    [["mmserve caption", cap["caption_s"], cap["caption_items_per_s"]],
                     ["transformers-style loop", cap["hf_caption_s"], cap["hf_items_per_s"]]])
        print(f"ratio {cap['caption_throughput_ratio_vs_hf']:.2f}x; identical captions "
              f"{cap['captions_identical']}/{cap['caption_items']}; failed {cap['caption_failed']}")
    results["wall_s"] = time.perf_counter() - t_start
    print(f"\n{results['wall_s']:.1f} s")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
