"""transformers' decode step split into the same stages as ``profile_step.py``'s, for a side-by-side table.

The HF model (eager attention, the same checkpoint and prompts) runs ``generate`` for ``1 + steps``
tokens; a streamer restarts the count once the first token is out, so the ``steps`` decode steps after
it are what is timed. Its module classes are wrapped with the same exclusive-time StageTimer; the
remainder of a step is transformers' generate loop (masks, cache bookkeeping, logits processors,
argmax, stopping criteria).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

# Stage groups both engines are summed into (ours: profile_step's stage names; HF's: below).
GROUPS = {
    "attention (projections, RoPE, KV write, attention)": ("attention (core)", "attention (proj, rope, store)",
                                                           "hf attention (proj, rope, cache, eager attention)"),
    "MoE experts": ("MoE (experts)", "hf MoE experts"),
    "MoE router + top-k": ("MoE (router, topk)", "hf MoE router + top-k"),
    "dense MLP": ("dense MLP", "hf dense MLP"),
    "norms": ("norms", "hf norms"),
    "LM head": ("LM head", "hf LM head"),
    "input preparation (inputs, plans / masks, rotary tables)": ("input preparation", "hf rotary tables"),
}


def hf_decode_stages(ckpt: Path, batch_prompts: list[list[int]], steps: int, timer) -> tuple[dict[str, float], float]:
    """(exclusive ms per decode step by stage, total ms per decode step) of transformers at this batch."""
    import transformers
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as hf_mod

    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    timer.wrap(hf_mod.MiMoV2FlashAttention, "forward", "hf attention (proj, rope, cache, eager attention)")
    timer.wrap(hf_mod.MiMoV2FlashTopkRouter, "forward", "hf MoE router + top-k")
    timer.wrap(hf_mod.MiMoV2FlashExperts, "forward", "hf MoE experts")
    timer.wrap(hf_mod.MiMoV2FlashMLP, "forward", "hf dense MLP")
    timer.wrap(hf_mod.MiMoV2FlashRMSNorm, "forward", "hf norms")
    timer.wrap(hf_mod.MiMoV2FlashRotaryEmbedding, "forward", "hf rotary tables")
    timer.wrap(hf.lm_head, "forward", "hf LM head")
    x = torch.tensor(batch_prompts)
    marker = _FirstTokenMark(timer)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=3, do_sample=False)  # warm-up
        timer.enabled = True
        hf.generate(x, max_new_tokens=1 + steps, do_sample=False, streamer=marker)
        timer.enabled = False
    stages = {k: 1e3 * v / steps for k, v in timer.total.items()}
    timer.reset()
    return stages, 1e3 * (marker.t_end - marker.t_first) / steps


class _FirstTokenMark(BaseStreamer):
    """Streamer that restarts the timer's totals once the first new token is out (put #2: put #1 is
    the prompt), so only the decode steps after it are counted, then stamps the end."""

    def __init__(self, timer) -> None:
        self.timer, self.puts = timer, 0
        self.t_first = self.t_end = 0.0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.timer.reset()
            self.t_first = self.timer.clock()

    def end(self) -> None:
        self.t_end = self.timer.clock()


def side_by_side(ours: dict[str, float], ours_total: float, hf: dict[str, float], hf_total: float) -> list[list]:
    """Rows [group, ours ms, transformers ms, transformers / ours] over GROUPS, the rest and the step."""
    rows, ours_acc, hf_acc = [], 0.0, 0.0
    for group, names in GROUPS.items():
        o = sum(ours.get(n, 0.0) for n in names)
        h = sum(hf.get(n, 0.0) for n in names)
        ours_acc, hf_acc = ours_acc + o, hf_acc + h
        rows.append([group, o, h, h / o if o else float("nan")])
    o, h = ours_total - ours_acc, hf_total - hf_acc
    rows.append(["sampling, scheduler / generate loop, Python", o, h, h / o if o else float("nan")])
    rows.append(["step", ours_total, hf_total, hf_total / ours_total])
    return rows
