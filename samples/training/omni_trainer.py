"""The trainable omni model: transformers' MiMoV2FlashForCausalLM (eager, autograd) as the text
part, our VisionTransformer and AudioEncoder as the towers, and the answer-only loss.

One step over a batch of prepared items:

    vision units of all items ─► one packed ViT forward ─┐
    audio segments of all items ─► one packed forward ───┤ rows in unit order
    input ids [B, L] (right-padded) ─► embed_tokens ─────┴─► rows written into their spans
        ─► decoder (causal: real tokens never see the right padding, so no mask is needed)
        ─► hidden at positions answer_start-1 .. L-2 ─► lm_head ─► CE vs ids answer_start .. L-1

The towers' public forwards run under ``torch.no_grad`` and update activations in place (serving);
training calls the same ``forward_packed`` bodies with the per-layer math rebound to out-of-place
twins (:mod:`samples.training.trainable_towers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio.encoder import AudioEncoder
from encoders.audio.packing import AudioPackedBatch
from encoders.vision.packing import VisionPackedBatch
from samples.checkpoints.tiny_towers import init_random_
from encoders.vision.tower import VisionTransformer
from samples.training.aux_targets import (
    CHANGE_CLASSES, COLOUR_CLASSES, EMITTED_CLASSES, IGNORE, INSTANCE_CLASSES, KIND_CLASSES, ORDINAL_CLASSES,
    PITCH_CLASSES, AuxTargets)
from samples.training.dataset import TrainItem
from samples.training.demo_model_config import DemoModelConfig
from samples.training.attention.text_attention import SDPA_SINKS
from samples.training.trainable_towers import audio_forward, make_trainable, vision_forward


VISION_INITS = ("random", "passthrough")


def zero_residual_outputs_(vision: VisionTransformer) -> VisionTransformer:
    """Zero each block's residual output projections (attn.proj, mlp.down_proj): every block starts
    as the identity, so the merger first sees the patch embedding itself (colour survives intact
    instead of being mixed away by 4 random blocks), and the blocks grow from there."""
    with torch.no_grad():
        for block in vision.blocks:
            for lin in (block.attn.proj, block.mlp.down_proj):
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()
    return vision


@dataclass(frozen=True)
class BatchLoss:
    loss: torch.Tensor              # caption loss (mean over answer tokens) + aux_weight * aux losses
    per_modality: dict[str, tuple[float, int]]  # modality -> (summed caption loss, answer tokens)
    aux: dict[str, float]           # aux target -> mean cross-entropy of this batch


def _add_ce(out: dict[str, torch.Tensor], name: str, head: nn.Linear, rows: torch.Tensor,
            target: torch.Tensor) -> None:
    """``out[name]`` = cross-entropy of ``head`` over the rows whose target is not IGNORE; nothing
    when there are none (a batch of tiny frames can hold no shape token: a mean over no rows is NaN)."""
    keep = target != IGNORE
    if keep.any():
        out[name] = F.cross_entropy(head(rows[keep]).float(), target[keep])


class AuxHeads(nn.Module):
    """Linear probes for the dense auxiliary targets (:mod:`samples.training.aux_targets`).
    Training-only: export writes text + towers, never these."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.colour = nn.Linear(hidden, COLOUR_CLASSES)
        self.kind = nn.Linear(hidden, KIND_CLASSES)
        self.instance = nn.Linear(hidden, INSTANCE_CLASSES)
        self.pitch = nn.Linear(hidden, PITCH_CLASSES)
        self.ordinal = nn.Linear(hidden, ORDINAL_CLASSES)
        self.change = nn.Linear(hidden, CHANGE_CLASSES)
        self.emitted = nn.Linear(hidden, EMITTED_CLASSES)
        self.group_colour = nn.Linear(hidden, COLOUR_CLASSES)
        self.group_kind = nn.Linear(hidden, KIND_CLASSES)


class OmniTrainModel(nn.Module):
    """Text model + towers, built from a :class:`DemoModelConfig` with a deterministic init."""

    def __init__(self, config: DemoModelConfig, pad_id: int, seed: int = 0,
                 vision_init: str = "random") -> None:
        super().__init__()
        if vision_init not in VISION_INITS:
            raise ValueError(f"vision_init must be one of {VISION_INITS}, got {vision_init!r}")
        from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

        torch.manual_seed(seed)
        hf_cfg = MiMoV2FlashConfig(**config.text, pad_token_id=pad_id, bos_token_id=None)
        # Eager's math (sinks + asymmetric head dims) through SDPA: ~2x faster on long-video batches.
        hf_cfg._attn_implementation = SDPA_SINKS
        self.text = MiMoV2FlashForCausalLM(hf_cfg)
        with torch.no_grad():
            for name, p in self.text.named_parameters():
                if name.endswith("sinks"):
                    p.zero_()
                elif name.endswith("mlp.gate.weight") and not p.abs().sum():
                    p.normal_(0.0, config.text["initializer_range"])  # zero router: all ties
        self.vision = make_trainable(init_random_(VisionTransformer(config.vision), seed + 1))
        if vision_init == "passthrough":
            zero_residual_outputs_(self.vision)
        self.audio = make_trainable(init_random_(AudioEncoder(config.audio), seed + 2))
        self.aux_heads = AuxHeads(config.text["hidden_size"])
        self.config = config
        self.pad_id = pad_id

    # ---- towers with gradients ------------------------------------------------------------------
    def _vision_rows(self, units: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
        if not units:
            return []
        batch = VisionPackedBatch.from_items(list(units), self.config.vision.spatial_merge_size)
        return batch.split(vision_forward(self.vision, batch))

    def _audio_rows(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not segments:
            return []
        batch = AudioPackedBatch.build(list(segments), self.config.audio)
        return batch.split(audio_forward(self.audio, batch))

    # ---- loss -------------------------------------------------------------------------------------
    def loss(self, items: Sequence[TrainItem], aux: Sequence[AuxTargets] | None = None,
             aux_weight: float = 0.0) -> BatchLoss:
        """Caption loss of a batch; with ``aux`` (one per item) and ``aux_weight > 0`` plus the
        weighted sum of the auxiliary cross-entropies."""
        use_aux = aux is not None and aux_weight > 0
        vis_units = [(u.float(), g) for it in items if it.modality != "audio" for u, g in zip(it.units, it.grids)]
        # audio clips' segments and videos' sound segments, in item order (rows are taken back so)
        aud_units = [u for it in items for u in (it.units if it.modality == "audio" else it.sound)]
        vis_list, aud_list = self._vision_rows(vis_units), self._audio_rows(aud_units)
        vis_rows, aud_rows = iter(vis_list), iter(aud_list)
        length = max(it.num_tokens for it in items)
        ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        for b, it in enumerate(items):
            ids[b, :it.num_tokens] = it.input_ids
        embeds = self.text.get_input_embeddings()(ids)
        for b, it in enumerate(items):
            rows = vis_rows if it.modality != "audio" else aud_rows
            for start, end in it.spans:
                r = next(rows)
                if r.shape[0] != end - start:
                    raise RuntimeError(f"unit gives {r.shape[0]} rows for a span of {end - start}")
                embeds[b, start:end] = r.to(embeds.dtype)
            sound = [next(aud_rows) for _ in it.sound] if it.modality != "audio" else []
            for start, end, seg, row in it.sound_spans:  # a video's sound, sliced by time
                embeds[b, start:end] = sound[seg][row:row + end - start].to(embeds.dtype)
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        if use_aux:
            for idx in {self.config.change_layer, self.config.ordinal_layer}:
                hooks.append(self.text.model.layers[idx].register_forward_hook(
                    lambda _m, _i, out, idx=idx: captured.__setitem__(idx, out[0] if isinstance(out, tuple) else out)))
        try:
            hidden = self.text.model(inputs_embeds=embeds, use_cache=False).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
        # Answer positions: token t is predicted from position t - 1.
        bi, ti = [], []
        for b, it in enumerate(items):
            t = torch.arange(it.answer_start, it.num_tokens)
            bi.append(torch.full_like(t, b))
            ti.append(t)
        bi_t, ti_t = torch.cat(bi), torch.cat(ti)
        logits = self.text.lm_head(hidden[bi_t, ti_t - 1]).float()
        tok_loss = F.cross_entropy(logits, ids[bi_t, ti_t], reduction="none")
        per: dict[str, tuple[float, int]] = {}
        offset = 0
        for it in items:
            n = it.num_tokens - it.answer_start
            s, c = per.get(it.modality, (0.0, 0))
            per[it.modality] = (s + float(tok_loss[offset:offset + n].detach().sum()), c + n)
            offset += n
        loss = tok_loss.mean()
        aux_losses: dict[str, torch.Tensor] = {}
        if use_aux:
            assert aux is not None and len(aux) == len(items)
            aux_losses = self._aux_losses(items, aux, vis_list, aud_list, captured)
            loss = loss + aux_weight * sum(aux_losses.values())
        return BatchLoss(loss, per, {k: float(v.detach()) for k, v in aux_losses.items()})

    def tower_loss(self, vision: Sequence[tuple[torch.Tensor, tuple[int, int, int], AuxTargets, int]],
                   audio: Sequence[tuple[torch.Tensor, AuxTargets]]) -> dict[str, torch.Tensor]:
        """Tower-only step (no text model): the dense tower targets of ``vision`` units
        (rows, grid, targets, unit index in the item) and ``audio`` clips (one segment each)."""
        vis_rows = self._vision_rows([(u.float(), g) for u, g, _, _ in vision])
        aud_rows = self._audio_rows([u for u, _ in audio])
        return self._tower_aux([(a, k) for _, _, a, k in vision], vis_rows, [a.pitch[0] for _, a in audio], aud_rows)

    def _tower_aux(self, vis_targets: Sequence[tuple[AuxTargets, int]], vis_rows: list[torch.Tensor],
                   aud_pitch: Sequence[torch.Tensor], aud_rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tower-token cross-entropies; ``aud_pitch[i]`` is the pitch target of ``aud_rows[i]``."""
        heads = self.aux_heads
        out: dict[str, torch.Tensor] = {}
        if vis_rows:
            rows = torch.cat(vis_rows)
            for name in ("colour", "kind", "instance"):
                target = torch.cat([getattr(a, name)[k] for a, k in vis_targets])
                _add_ce(out, name, getattr(heads, name), rows, target)
        if aud_rows:
            _add_ce(out, "pitch", heads.pitch, torch.cat(aud_rows), torch.cat(list(aud_pitch)))
        return out

    def _aux_losses(self, items: Sequence[TrainItem], aux: Sequence[AuxTargets], vis_rows: list[torch.Tensor],
                    aud_rows: list[torch.Tensor], text_hidden: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        heads = self.aux_heads
        vis_targets = [(a, k) for it, a in zip(items, aux) if it.modality != "audio" for k in range(len(it.units))]
        # aud_rows holds audio clips' segments and videos' sound segments in item order; a video
        # without sound pitch targets (its sound carries no beeps we know of) adds no rows
        pitch_rows, pitch, rows = [], [], iter(aud_rows)
        for it, a in zip(items, aux):
            targets = a.pitch if it.modality == "audio" else a.sound_pitch
            for k, _ in enumerate(it.units if it.modality == "audio" else it.sound):
                r = next(rows)
                if k < len(targets):
                    if targets[k].shape[0] != r.shape[0]:
                        raise RuntimeError(f"{targets[k].shape[0]} pitch targets for {r.shape[0]} audio rows")
                    pitch_rows.append(r), pitch.append(targets[k])
        out = self._tower_aux(vis_targets, vis_rows, pitch, pitch_rows)
        layers = {"ordinal": self.config.ordinal_layer, "emitted": self.config.ordinal_layer,
                  "change": self.config.change_layer, "group_colour": self.config.change_layer,
                  "group_kind": self.config.change_layer}
        for name, layer in layers.items():
            hidden = text_hidden[layer]
            target = torch.full(hidden.shape[:2], IGNORE, dtype=torch.long)
            for b, (it, a) in enumerate(zip(items, aux)):
                target[b, :it.num_tokens] = getattr(a, name)
            _add_ce(out, name, getattr(heads, name), hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1))
        return out

    def param_groups(self, weight_decay: float, vision_lr_mult: float = 1.0) -> list[dict[str, Any]]:
        """AdamW groups: no decay on norms, biases, sinks and 1-D params; the vision tower (blocks
        and merger) gets ``lr_mult = vision_lr_mult`` (the trainer scales each group's lr by it)."""
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.named_parameters():
            no_decay = p.dim() < 2 or name.endswith("sinks")
            groups.setdefault((name.startswith("vision."), no_decay), []).append(p)
        return [{"params": ps, "weight_decay": 0.0 if nd else weight_decay,
                 "lr_mult": vision_lr_mult if vis else 1.0}
                for (vis, nd), ps in sorted(groups.items())]
