"""Train the demo model's MTP layers (the main model frozen) and save them as ``model-mtp.safetensors``.

    python -m samples.training.train_mtp --model samples/demo-model --minutes 6 --seed 0

1. Data: fresh synthetic media (``samples.synthetic``, seed ``--data-seed``; images, videos, audio
   clips and videos with a beeping sound track) captioned by the demo model itself through the real
   serving path (MultimodalLLM, greedy, one request at a time, no
   prefix cache, no speculation). A forward hook on the text model records, for every position, the
   model's input row (token embedding or media row) and its final-normed hidden state.
2. Targets: the main model's *own* greedy continuation (prompt + generated caption), not the
   ground-truth caption. Acceptance measures agreement with the target's greedy tokens, so the head
   must imitate the model, including its rare mistakes; both agree on ~97 % of captions anyway.
3. Loss (cross-entropy through the frozen shared LM head, on caption positions), for the two ways
   the engine drafts (llm_core/engine/speculative/proposer.py):
   - "first": layer 0 run 3 times, pass s taking the hidden state of pass s - 1 one row back, its
     attention seeing pass-0 keys up to s rows back and pass-r keys on the diagonal, exactly the KV
     the engine's draft steps see;
   - "chain": layer s on the output of layer s - 1 one row back (DeepSeek-V3 MTP), teacher-forced.
4. Export: the three layers in the checkpoint's own spelling (fused qkv in its disk row order),
   registered in model.safetensors.index.json. The dense training forward is checked against the
   engine's paged one before saving.

Deterministic data and init (seeded); training length follows ``--minutes`` (and ``--steps``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from llm_core.model.config import ModelConfig
from llm_core.model.layers.fused_qkv import chunk_count, plain_rows_of_disk
from llm_core.model.mtp import MTP_PREFIX, MTPHead, MTPLayer, sliding_layer_config
from samples.training.attention.sink_key import sdpa_with_sinks

MTP_FILE = "model-mtp.safetensors"
NUM_LAYERS = 3
DRAFT_STEPS = 3


# ---- 1. data: the model's own captions and hidden states -------------------------------------------
def collect(model_dir: Path, media_dir: Path, seed: int, images: int, videos: int, audios: int,
            beeping_videos: int = 0) -> list[dict]:
    """Generate the synthetic media and record the model captioning each item (see ``record``).
    Beeping videos are captioned with their sound (the checkpoint's ``use_audio_in_video``), so the
    head also learns the hidden states of the caption's "beeps: ..." half."""
    from samples.synthetic.generate import generate

    labels = generate(seed, media_dir, images=images, videos=videos, audios=audios, max_video_seconds=6,
                      beeping_videos=beeping_videos)
    return record(model_dir, media_dir, labels)


def collect_prompts(model_dir: Path, media_dir: Path) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt ids, prompt input rows) of the model's captioning request for each item of a
    ``labels.jsonl`` directory (benchmarks/speculative.py replays them without the encoders)."""
    from samples.synthetic.generate import read_labels

    data = record(model_dir, media_dir, read_labels(media_dir / "labels.jsonl"))
    return [(d["tokens"][: d["prompt_len"]].tolist(), d["embeds"][: d["prompt_len"]]) for d in data]


def record(model_dir: Path, media_dir: Path, labels: list[dict]) -> list[dict]:
    """Caption each labelled item through MultimodalLLM (greedy, one at a time) and keep, per item:
    ``tokens`` (prompt + caption), ``embeds`` / ``hidden`` (the text model's input row and final-normed
    hidden state of every computed position) and ``prompt_len``."""
    from llm_core import SamplingParams
    from mm_pipeline.multimodal_llm import MultimodalLLM

    llm = MultimodalLLM(model_dir, speculative_tokens=0, enable_prefix_caching=False, max_num_seqs=1)
    runner = llm.engine.runtime.llm.runner
    runner.every_row_hidden = True  # the hook below records every position, not only the sampled ones
    text = runner.model
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs, output):
        input_ids, batch = args[0], args[1]
        embeds = kwargs.get("inputs_embeds", args[3] if len(args) > 3 else None)
        x = embeds if embeds is not None else module.embed(input_ids)
        rows.append((batch.positions.detach().cpu(), x.detach().cpu().float(), output.detach().cpu().float()))

    handle = text.register_forward_hook(hook, with_kwargs=True)
    kinds = {"image": "image_url", "video": "video_url", "audio": "audio_url"}
    prompts = {"image": "Describe this image.", "video": "Describe this video.", "audio": "Describe this audio."}
    data = []
    try:
        for lab in labels:
            path = str((media_dir / lab["path"]).resolve())
            kind = lab["modality"]
            part = {"type": kinds[kind], kinds[kind]: {"url": path}}
            rows.clear()
            out = llm.chat([[{"role": "user", "content": [part, {"type": "text", "text": prompts[kind]}]}]],
                           SamplingParams(max_tokens=64, temperature=0.0))[0]
            if out.finish_reason == "error":
                continue
            tokens = list(out.prompt_token_ids) + list(out.token_ids)
            pos = torch.cat([r[0] for r in rows])
            order = pos.argsort()
            x, h = torch.cat([r[1] for r in rows])[order], torch.cat([r[2] for r in rows])[order]
            if not torch.equal(pos[order], torch.arange(len(tokens) - 1)):
                raise RuntimeError(f"{lab['path']}: recorded positions do not cover the sequence once")
            data.append(dict(tokens=torch.tensor(tokens), embeds=x, hidden=h, prompt_len=len(out.prompt_token_ids)))
    finally:
        handle.remove()
        llm.close()
    return data


# ---- 2. the dense (differentiable) forward of one MTP layer, several draft passes --------------------
def _qkv(layer: MTPLayer, x: torch.Tensor, positions: torch.Tensor):
    attn = layer.self_attn
    spec = attn.spec
    qkv = attn.qkv_proj(layer.input_layernorm(x))
    q = qkv[:, : spec.q_size].view(-1, spec.num_heads, spec.head_dim)
    k = qkv[:, spec.q_size: spec.q_size + spec.k_size].view(-1, spec.num_kv_heads, spec.head_dim)
    v = qkv[:, spec.q_size + spec.k_size:].view(-1, spec.num_kv_heads, spec.v_head_dim) * attn.value_scale
    q, k = attn.rotary(positions, q, k)
    return q, k, v


def _attend(layer: MTPLayer, q, keys, values, allowed) -> torch.Tensor:
    attn = layer.self_attn
    spec = attn.spec
    rep = spec.num_heads // spec.num_kv_heads
    k = torch.cat(keys).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    v = torch.cat(values).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    out = sdpa_with_sinks(q.transpose(0, 1)[None], k, v, allowed[None, None], attn.scale, attn.attention_sink_bias)
    return attn.o_proj(out[0].transpose(0, 1).reshape(q.shape[0], -1))


def _finish(layer: MTPLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    x = x + attn_out
    x = x + layer.mlp(layer.pre_mlp_layernorm(x))
    return layer.final_layernorm(x)


def shift(h: torch.Tensor) -> torch.Tensor:
    """Row q gets row q - 1 (zeros at row 0), as the engine's extend does."""
    return torch.cat([torch.zeros_like(h[:1]), h[:-1]])


def first_mode_passes(layer: MTPLayer, embeds, hidden, window: int, steps: int) -> list[torch.Tensor]:
    """Outputs of the "first" mode's draft passes 0..steps-1 over every row (teacher forcing): pass s
    at row q stands for draft step s at position q; its keys are pass 0 for rows <= q - s (the extend
    and draft step 0) and pass r at row q - s + r (draft steps 1..s)."""
    n = embeds.shape[0]
    pos = torch.arange(n)
    qi, kj = pos[:, None], pos[None, :]
    keys, values, outs, h_prev = [], [], [], shift(hidden)
    for s in range(steps):
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(h_prev)], dim=-1))
        q, k, v = _qkv(layer, x, pos)
        keys.append(k)
        values.append(v)
        masks = [(kj <= qi - s) & (kj > qi - window)] + [kj == qi - s + r for r in range(1, s + 1)]
        outs.append(_finish(layer, x, _attend(layer, q, keys, values, torch.cat(masks, dim=1))))
        h_prev = shift(outs[-1])
    return outs


def chain_passes(head: MTPHead, embeds, hidden, window: int) -> list[torch.Tensor]:
    n = embeds.shape[0]
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    outs, src = [], hidden
    for layer in head.layers:
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(shift(src))], dim=-1))
        q, k, v = _qkv(layer, x, pos)
        src = _finish(layer, x, _attend(layer, q, [k], [v], allowed))
        outs.append(src)
    return outs


# ---- 3. training -------------------------------------------------------------------------------------
def loss_of(head: MTPHead, lm_head, item: dict, window: int) -> torch.Tensor:
    tokens, embeds, hidden, p = item["tokens"], item["embeds"], item["hidden"], item["prompt_len"]
    n = embeds.shape[0]
    # row q predicts t_{q+1}; drafts happen from the first pending token on (position >= p)
    rows = torch.arange(max(p - 1, 1), n - 1)
    if len(rows) == 0:
        return embeds.new_zeros(())
    target = tokens[rows + 1]
    losses = []
    for out in first_mode_passes(head.layers[0], embeds, hidden, window, DRAFT_STEPS)[1:] + chain_passes(head, embeds, hidden, window):
        losses.append(F.cross_entropy(lm_head(out[rows]), target))
    return torch.stack(losses).sum()


def train(head: MTPHead, lm_head, data: list[dict], window: int, minutes: float, steps: int, seed: int,
          lr: float) -> int:
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    deadline = time.monotonic() + 60 * minutes
    step = 0
    while step < steps and time.monotonic() < deadline:
        batch = rng.sample(data, min(8, len(data)))
        loss = sum(loss_of(head, lm_head, it, window) for it in batch) / len(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        for g in opt.param_groups:
            g["lr"] = lr * max(0.05, 1.0 - (time.monotonic() - deadline + 60 * minutes) / (60 * minutes))
        if step % 25 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
        step += 1
    return step


@torch.no_grad()
def accuracy(head: MTPHead, lm_head, data: list[dict], window: int) -> dict[str, float]:
    """Teacher-forced next-token accuracy per draft pass on caption rows (an acceptance proxy)."""
    hits: dict[str, list[int]] = {}
    for it in data:
        p, n = it["prompt_len"], it["embeds"].shape[0]
        rows = torch.arange(max(p - 1, 1), n - 1)
        target = it["tokens"][rows + 1]
        first = first_mode_passes(head.layers[0], it["embeds"], it["hidden"], window, DRAFT_STEPS)
        chain = chain_passes(head, it["embeds"], it["hidden"], window)
        for name, outs in (("first", first), ("chain", chain)):
            for s, out in enumerate(outs):
                ok = (lm_head(out[rows]).argmax(-1) == target)
                h = hits.setdefault(f"{name}{s}", [0, 0])
                h[0] += int(ok.sum())
                h[1] += len(rows)
    return {k: a / max(b, 1) for k, a, b in ((k, *v) for k, v in hits.items())}


# ---- 4. export -----------------------------------------------------------------------------------------
def export(head: MTPHead, config: ModelConfig, model_dir: Path) -> Path:
    spec = sliding_layer_config(config).attn_spec(0)
    tensors = {}
    for j, layer in enumerate(head.layers):
        for name, p in layer.named_parameters():
            full = f"{MTP_PREFIX}{j}.{name}"
            t = p.detach().float().contiguous()
            if name == "self_attn.qkv_proj.weight" and config.qkv_layout == "fused":
                t = t[plain_rows_of_disk(spec, chunk_count(spec, config.fused_qkv_chunks, "tp4_chunks"))].contiguous()
            elif name == "self_attn.qkv_proj.weight":
                q, k = spec.q_size, spec.k_size
                tensors[full.replace("qkv_proj", "q_proj")] = t[:q].contiguous()
                tensors[full.replace("qkv_proj", "k_proj")] = t[q:q + k].contiguous()
                tensors[full.replace("qkv_proj", "v_proj")] = t[q + k:].contiguous()
                continue
            tensors[full] = t
    path = model_dir / MTP_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        raw = index_path.read_text()
        index = json.loads(raw)
        wm = {n: f for n, f in index["weight_map"].items() if not n.startswith("model.mtp.")}
        wm.update({n: MTP_FILE for n in sorted(tensors)})  # appended: the main entries keep their order
        index["weight_map"] = wm
        index_path.write_text(json.dumps(index, indent=1 if raw.startswith('{\n "') else 2) + "\n" * raw.endswith("\n"))
    return path


@torch.no_grad()
def check_against_engine(model_dir: Path, item: dict) -> float:
    """Reload the checkpoint and run the engine's own extend over one sequence: its layer-0 output
    must equal the dense training forward (same weights, same rows)."""
    from llm_core.engine.batch_builder import build_forward_batch
    from llm_core.engine.request import Request
    from llm_core.engine.sampling import SamplingParams
    from llm_core.engine.scheduled_batch import ScheduledRequest
    from llm_core.kvcache.dual_pool import DualKVPool, KVLayout
    from llm_core.model.loader import load_model

    model = load_model(model_dir)
    head = model.model.mtp
    n = item["embeds"].shape[0]
    layout = KVLayout.from_model_config(model.config)
    layout = KVLayout(layout.layer_kinds + ("sliding",), layout.full, layout.sliding, layout.window)
    pool = DualKVPool(layout, page_size=16, dtype=torch.float32, device="cpu", num_full_tokens=n + 32,
                      num_swa_tokens=n + 32)
    req = Request("x", item["tokens"][:n].tolist(), SamplingParams(), 0)
    pages = -(-n // 16)
    req.full_pages, req.swa_pages = pool.full.allocate(pages), pool.swa.allocate(pages)
    fb, _ = build_forward_batch([ScheduledRequest(req, 0, n)], 16, torch.device("cpu"))
    engine_out = head.layers[0](item["embeds"], shift(item["hidden"]), fb, *pool.layer(model.config.num_layers))
    dense = first_mode_passes(head.layers[0], item["embeds"], item["hidden"], model.config.sliding_window, 1)[0]
    return float((engine_out - dense).abs().max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train the demo model's MTP layers (main model frozen).")
    ap.add_argument("--model", type=Path, default=Path("samples/demo-model"))
    ap.add_argument("--minutes", type=float, default=5.0, help="training time (data collection, ~3 min, not included)")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=5150, help="synthetic media seed (not an evaluation seed)")
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--videos", type=int, default=30)
    ap.add_argument("--audios", type=int, default=40)
    ap.add_argument("--beeping-videos", type=int, default=30, help="videos with a beeping sound track")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mmserve-train-mtp"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    data = collect(args.model, args.work / f"media-{args.data_seed}", args.data_seed, args.images, args.videos,
                   args.audios, args.beeping_videos)
    print(f"collected {len(data)} sequences ({sum(d['embeds'].shape[0] for d in data)} rows) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    from llm_core.model.loader import load_model

    main_model = load_model(args.model, load_mtp=False)
    config = main_model.config
    for p in main_model.parameters():
        p.requires_grad_(False)
    head = MTPHead(config, NUM_LAYERS)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("sink_bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    rng = random.Random(args.seed)
    held = set(rng.sample(range(len(data)), max(1, len(data) // 10)))
    train_set = [d for i, d in enumerate(data) if i not in held]
    eval_set = [d for i, d in enumerate(data) if i in held]
    steps = train(head, main_model.lm_head, train_set, config.sliding_window, args.minutes, args.steps, args.seed, args.lr)
    acc = accuracy(head, main_model.lm_head, eval_set, config.sliding_window)
    print(f"{steps} steps; held-out teacher-forced accuracy per pass: " +
          ", ".join(f"{k} {v:.3f}" for k, v in sorted(acc.items())), flush=True)
    path = export(head, config, args.model)
    err = check_against_engine(args.model, eval_set[0])
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); engine vs training forward max |diff| {err:.2e}")
    if err > 1e-3:
        raise SystemExit("the engine's MTP forward disagrees with the training forward")


if __name__ == "__main__":
    main()
