"""Train the demo model on the synthetic caption task and write it as a servable checkpoint.

    python -m samples.training.train --out samples/demo-model --seed 0 [--steps N] [--minutes M] \
        [--tower-minutes 12] [--vision-init passthrough] [--vision-lr-mult 0.5] [--vision-first 0.35] \
        [--modality-weights video=2] [--threads 1] [--procs 2] [--init-from samples/demo-model]

(samples/demo-model/TRAINING.md has the exact command of the committed weights.)

Data: ``training_refs(seed)`` -- images, audio clips, short videos (<= 12 s) and long videos (<= 60 s)
from synthetic seeds that evaluation never uses (eval: any seed not in 10_000..10_099), prepared
through the server's decode + preprocess code and cached under ``--cache`` (~/.cache/mmserve-train).

Schedule: AdamW, linear warm-up then cosine decay to 10 %; batches are cut from shuffled pools of
items sorted by length under a token budget, so every batch mixes modalities of similar length.
With ``--steps`` only, the run is deterministic for a seed; ``--minutes`` additionally stops at a
wall-clock budget and then drives the schedule by elapsed time (documented, not bit-reproducible).
``--init-from DIR`` fine-tunes: the trainable model starts from the weights of the demo checkpoint
in DIR (:func:`samples.training.export.load_checkpoint_into`; a name or shape mismatch is an error),
and the tower phase is skipped unless asked for.
The checkpoint is exported every ``--save-every`` steps and at the end. ``--modality-weights``
repeats or thins a modality per epoch; ``--procs N`` trains data-parallel, one process per core
(:mod:`samples.training.data_parallel`).

Vision recipe: ``--vision-init passthrough`` starts every ViT block as the identity (residual output
projections zeroed), ``--vision-lr-mult`` scales the tower's (blocks + merger) learning rate, and
``--vision-first F`` is a curriculum: for the first fraction F of the run (of steps, or of the time
budget) batches hold only images and videos; afterwards every modality is mixed.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from samples.checkpoints.tiny_omni import tiny_special_tokens
from samples.training.aux_targets import aux_targets, separator_ids
from samples.training.data_parallel import DataParallel, rendezvous_file
from samples.training.dataset import (DEFAULT_CACHE, PROMPTS, ItemPreparer, ItemRef, TrainItem, load_item,
                                         prepare_items)
from samples.training.demo_model_config import DemoModelConfig
from samples.training.export import export_checkpoint, load_checkpoint_into
from samples.training.omni_trainer import VISION_INITS, OmniTrainModel
from samples.training.tower_pretrain import pretrain_towers

SEED_BASE = 10_000


def training_refs(seed: int, images: int = 2000, audios: int = 1200, short_videos: int = 900,
                  long_videos: int = 500, beeping_videos: int = 0, long_beeping_videos: int = 0) -> list[ItemRef]:
    """The training set of run ``seed`` (synthetic seeds 10_000 + 4 * seed + {0, 1, 2, 3}; beeping
    videos of <= 30 s under the short videos' seed and of <= 60 s under the long videos' seed, from
    their own random stream). Sound tracks over 30 s span two audio segments: a model trained on
    the short ones alone misses the beeps of a longer video's second segment."""
    if not 0 <= seed < 25:
        raise ValueError(f"training seed must be in [0, 25) so synthetic seeds stay in 10_000..10_099, got {seed}")
    s = SEED_BASE + 4 * seed
    return ([ItemRef("image", s, i) for i in range(images)]
            + [ItemRef("audio", s + 1, i) for i in range(audios)]
            + [ItemRef("video", s + 2, i, 12.0) for i in range(short_videos)]
            + [ItemRef("video", s + 3, i, 60.0) for i in range(long_videos)]
            + [ItemRef("beeping_video", s + 2, i, 30.0) for i in range(beeping_videos)]
            + [ItemRef("beeping_video", s + 3, i, 60.0) for i in range(long_beeping_videos)])


def make_batches(items: Sequence[TrainItem], rng: random.Random, token_budget: int, pool: int = 96,
                 weights: Mapping[str, float] | None = None) -> list[list[int]]:
    """One epoch of batches (indices): shuffle, cut into pools, sort a pool by length, fill batches
    while ``len(batch) * longest <= token_budget`` (padded size), shuffle the batches.

    ``weights`` (modality -> expected copies per epoch, default 1) over- or under-samples a
    modality: an item of weight w appears floor(w) times plus once more with probability
    frac(w). The demo spends its steps where the loss is (videos), not on solved audio."""
    order = []
    for i, it in enumerate(items):
        w = 1.0 if weights is None else weights.get(it.modality, 1.0)
        frac = w - int(w)
        order += [i] * (int(w) + (frac > 0 and rng.random() < frac))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for p in range(0, len(order), pool):
        chunk = sorted(order[p:p + pool], key=lambda i: items[i].num_tokens)
        cur: list[int] = []
        for i in chunk:
            longest = max([items[j].num_tokens for j in cur] + [items[i].num_tokens])
            if cur and (len(cur) + 1) * longest > token_budget:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def parse_weights(text: str) -> dict[str, float]:
    """``"video=2,audio=0.5"`` -> {"video": 2.0, "audio": 0.5}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in PROMPTS:
            raise argparse.ArgumentTypeError(f"expected modality=weight with modality {'/'.join(PROMPTS)}, got {part!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {name} is not a number: {value!r}") from None
        if not 0.0 <= out[name] <= 8.0:
            raise argparse.ArgumentTypeError(f"weight of {name} must be in [0, 8], got {out[name]}")
    return out


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train the demo omni model (issue F).")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--minutes", type=float, default=None, help="wall-clock budget (schedule follows time)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--token-budget", type=int, default=3072, help="padded tokens per batch (per process)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--workers", type=int, default=2, help="processes preparing items")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per training process")
    ap.add_argument("--procs", type=int, default=1,
                    help="data-parallel training processes (gloo on loopback); one per core pays, threads do not")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--vision-init", choices=VISION_INITS, default="random",
                    help="passthrough: ViT blocks start as the identity")
    ap.add_argument("--vision-lr-mult", type=float, default=1.0, help="lr factor for the vision tower")
    ap.add_argument("--vision-first", type=float, default=0.0,
                    help="fraction of the run that trains on images + videos only")
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the dense auxiliary targets (0 = caption loss only)")
    ap.add_argument("--tower-minutes", type=float, default=0.0,
                    help="phase 1: train only the towers on their dense targets this long (part of --minutes)")
    ap.add_argument("--tower-steps", type=int, default=None, help="phase 1 by step count instead of time")
    ap.add_argument("--tower-lr", type=float, default=4e-3)
    ap.add_argument("--images", type=int, default=2000, help="training images")
    ap.add_argument("--audios", type=int, default=1200, help="training audio clips")
    ap.add_argument("--short-videos", type=int, default=900, help="training videos of <= 12 s")
    ap.add_argument("--long-videos", type=int, default=500, help="training videos of <= 60 s")
    ap.add_argument("--beeping-videos", type=int, default=0,
                    help="training videos of <= 30 s with a sound track of beeps (caption: colours; beeps)")
    ap.add_argument("--long-beeping-videos", type=int, default=0,
                    help="training videos of <= 60 s with a sound track of beeps")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="fine-tune: start from this demo checkpoint's weights (text model + towers; names and "
                         "shapes must match). No tower phase unless --tower-minutes/--tower-steps ask for one")
    ap.add_argument("--modality-weights", type=parse_weights, default={},
                    help="copies per epoch by modality, e.g. video=2,audio=0.5 (default 1 each)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.vision_first < 1.0:
        raise SystemExit(f"--vision-first must be in [0, 1), got {args.vision_first}")
    if args.minutes and args.tower_minutes >= args.minutes:
        raise SystemExit(f"--tower-minutes {args.tower_minutes} leaves nothing of --minutes {args.minutes}")
    if (args.tower_minutes > 0 or args.tower_steps) and args.aux_weight <= 0:
        raise SystemExit("--tower-minutes / --tower-steps need the aux targets (--aux-weight > 0)")
    if all(args.modality_weights.get(m, 1.0) == 0 for m in PROMPTS):
        raise SystemExit("--modality-weights leaves no modality to train on")
    if args.init_from is not None and not (args.init_from / "config.json").is_file():
        raise SystemExit(f"--init-from {args.init_from}: no config.json there (not a checkpoint directory)")
    if not 1 <= args.procs <= 8:
        raise SystemExit(f"--procs must be in [1, 8], got {args.procs}")

    t0 = time.time()
    refs = _refs(args)
    prepare_items(refs, DemoModelConfig(), args.cache, args.workers)
    print(f"prepared {len(refs)} items in {time.time() - t0:.0f} s", flush=True)
    if args.prepare_only:
        return
    if args.procs == 1:
        _train(0, args, None)
    else:
        import torch.multiprocessing as mp

        with rendezvous_file() as rendezvous:
            mp.spawn(_train, args=(args, rendezvous), nprocs=args.procs, join=True)


def _train(rank: int, args: argparse.Namespace, rendezvous: str | None) -> None:
    """One training process (rank ``rank`` of ``args.procs``); rank 0 logs and exports."""
    dp = DataParallel(rank, args.procs, rendezvous)
    torch.set_num_threads(args.threads)
    config = DemoModelConfig()
    t0 = time.time()
    refs = _refs(args)
    items = [load_item(p) for p in prepare_items(refs, config, args.cache, workers=1)]  # all cached
    log = print if dp.is_main else (lambda *a, **k: None)
    aux = None
    if args.aux_weight > 0:
        preparer = ItemPreparer(config)
        merge, seps = config.vision.spatial_merge_size, separator_ids(preparer.tokenizer)
        aux = [aux_targets(r, it, merge, preparer.sampling, seps) for r, it in zip(refs, items)]
        log(f"loaded {len(items)} items and their aux targets in {time.time() - t0:.0f} s", flush=True)
    # Batches come from one stream every rank draws identically (rank r trains on every world-th
    # batch); the tower phase samples per rank.
    rng = random.Random(args.seed)
    model = OmniTrainModel(config, pad_id=tiny_special_tokens().pad, seed=args.seed, vision_init=args.vision_init)
    if args.init_from is not None:
        load_checkpoint_into(model, args.init_from)  # the same on every rank: no broadcast needed
        log(f"initialised from {args.init_from}", flush=True)
    opt = torch.optim.AdamW(model.param_groups(0.01, args.vision_lr_mult), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    tower_steps = 0
    if args.tower_minutes > 0 or args.tower_steps:
        t1 = time.time()
        tower_rng = rng if dp.world == 1 else random.Random(args.seed * 1000 + 1 + rank)
        tower_steps = pretrain_towers(model, items, aux, seconds=args.tower_minutes * 60 if args.tower_minutes else None,
                                      steps=args.tower_steps, lr=args.tower_lr, rng=tower_rng, dp=dp,
                                      log=log)
        log(f"tower phase: {tower_steps} steps in {time.time() - t1:.0f} s", flush=True)
    vision_only = [i for i, it in enumerate(items) if it.modality != "audio"]
    in_curriculum = args.vision_first > 0
    start = time.time()
    budget_s = (args.minutes - args.tower_minutes) * 60 if args.minutes else None
    batches: list[list[int]] = []
    stats: dict[str, list[float]] = {}
    step, last_loss = 0, float("nan")
    while step < args.steps:
        elapsed = dp.agree(time.time() - start)
        if budget_s is not None and elapsed >= budget_s:
            break
        progress = elapsed / budget_s if budget_s is not None else step / args.steps
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args.lr) * g["lr_mult"]
        if in_curriculum and progress >= args.vision_first:
            in_curriculum, batches = False, []  # curriculum over: next epoch mixes every modality
            log(f"step {step}: curriculum done, mixing in audio", flush=True)
        if len(batches) < dp.world:  # a new epoch (a leftover shorter than one batch per rank is dropped)
            if in_curriculum:
                sub = [items[i] for i in vision_only]
                batches = [[vision_only[j] for j in b] for b in make_batches(sub, rng, args.token_budget)]
            else:
                batches = make_batches(items, rng, args.token_budget, weights=args.modality_weights)
            if len(batches) < dp.world:
                raise RuntimeError(f"an epoch gives {len(batches)} batches, fewer than --procs {dp.world}: "
                                   "use more items or fewer processes")
        batch = batches[-1 - rank]
        del batches[-dp.world:]
        out = model.loss([items[i] for i in batch], [aux[i] for i in batch] if aux else None, args.aux_weight)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        dp.average_gradients(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        last_loss = out.loss.item()
        for m, (s, n) in out.per_modality.items():
            acc = stats.setdefault(m, [0.0, 0])
            acc[0] += s
            acc[1] += n
        for name, value in out.aux.items():
            acc = stats.setdefault("aux_" + name, [0.0, 0])
            acc[0] += value
            acc[1] += 1
        if step % 25 == 0:
            per = " ".join(f"{m}={s / max(n, 1):.4f}" for m, (s, n) in sorted(stats.items()))
            log(f"step {step} t={time.time() - start:.0f}s lr={opt.param_groups[0]['lr']:.2e} "
                f"loss={last_loss:.4f} [{per}]", flush=True)
            stats = {}
        if step % args.save_every == 0 and dp.is_main:
            export_checkpoint(model, args.out, _train_info(args, step, start, last_loss, tower_steps),
                          hears_video_sound=args.beeping_videos + args.long_beeping_videos > 0)
    if dp.is_main:
        export_checkpoint(model, args.out, _train_info(args, step, start, last_loss, tower_steps),
                          hears_video_sound=args.beeping_videos + args.long_beeping_videos > 0)
    log(f"done: {step} steps in {time.time() - start:.0f} s, final batch loss {last_loss:.4f} (rank 0); "
        f"wrote {args.out}", flush=True)
    dp.exit_worker()


def _refs(args: argparse.Namespace) -> list[ItemRef]:
    return training_refs(args.seed, args.images, args.audios, args.short_videos, args.long_videos,
                         args.beeping_videos, args.long_beeping_videos)


def _train_info(args: argparse.Namespace, step: int, start: float, loss: float, tower_steps: int) -> dict:
    return {"demo_training": {"seed": args.seed, "steps": step, "wall_s": round(time.time() - start),
                              "final_batch_loss": round(loss, 5), "lr": args.lr,
                              "token_budget": args.token_budget, "procs": args.procs,
                              "vision_init": args.vision_init,
                              "init_from": str(args.init_from) if args.init_from else None,
                              "vision_lr_mult": args.vision_lr_mult, "vision_first": args.vision_first,
                              "aux_weight": args.aux_weight, "tower_steps": tower_steps,
                              "tower_minutes": args.tower_minutes, "tower_lr": args.tower_lr,
                              "modality_weights": args.modality_weights,
                              "items": {"images": args.images, "audios": args.audios,
                                        "short_videos": args.short_videos, "long_videos": args.long_videos,
                                        "beeping_videos": args.beeping_videos,
                                        "long_beeping_videos": args.long_beeping_videos}}}


if __name__ == "__main__":
    main()
