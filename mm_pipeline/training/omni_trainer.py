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
twins (:mod:`mm_pipeline.training.trainable_towers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio import AudioEncoder
from encoders.audio_packing import AudioPackedBatch
from encoders.packing import VisionPackedBatch
from encoders.tiny import init_random_
from encoders.vision import VisionTransformer
from mm_pipeline.training.dataset import TrainItem
from mm_pipeline.training.demo_model_config import DemoModelConfig
from mm_pipeline.training.trainable_towers import audio_forward, make_trainable, vision_forward


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
    loss: torch.Tensor              # mean over answer tokens of the batch
    per_modality: dict[str, tuple[float, int]]  # modality -> (summed loss, answer tokens)


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
        hf_cfg._attn_implementation = "eager"  # sinks + asymmetric head dims: eager is the exact path
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
    def loss(self, items: Sequence[TrainItem]) -> BatchLoss:
        vis_units = [(u.float(), g) for it in items if it.modality != "audio" for u, g in zip(it.units, it.grids)]
        aud_units = [u for it in items if it.modality == "audio" for u in it.units]
        vis_rows, aud_rows = iter(self._vision_rows(vis_units)), iter(self._audio_rows(aud_units))
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
        hidden = self.text.model(inputs_embeds=embeds, use_cache=False).last_hidden_state
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
        return BatchLoss(tok_loss.mean(), per)

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
