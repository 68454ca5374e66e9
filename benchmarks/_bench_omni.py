"""The omni model and requests the pipeline benchmarks share (pipeline.py, same_prefix.py,
repeat_step.py, mixed_media.py, encoder_lanes.py, intra_op_threads.py): a small omni checkpoint with
real-size pixel budgets, the engine settings, chat messages with a data-URL part, and the time to a
request's first token."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from llm_core.engine.sampling import SamplingParams
from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

BENCH_VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, num_key_value_heads=2, head_dim=64,
                    fullatt_block_indexes=(0, 3), vit_window_attn_types=(-1, 0, 1, -1), window=16)
BENCH_TEXT = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, max_position_embeddings=16384)


def build_model(root: Path) -> Path:
    """A small omni checkpoint (ViT hidden 256, text hidden 256 MoE) with real-sized pixel budgets."""
    out = build_tiny_omni_checkpoint(root / "model", vision_config=BENCH_VISION, **BENCH_TEXT)
    cfg = json.loads((out / "config.json").read_text())
    cfg["processor_config"].update({"image_max_pixels": 256 * 256, "video_max_pixels": 192 * 256,
                                    "video_total_max_pixels": 192 * 256 * 1024, "max_frames": 256})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# where the engines run (--device): CPU in float32 unless asked; a CUDA run takes bf16 as `mmserve` does there
ENGINE_DEVICE = {"device": "cpu", "dtype": "float32"}


def engine_config(**kw) -> OmniEngineConfig:
    base = dict(page_size=16, num_full_tokens=1 << 16, num_swa_tokens=1 << 14, max_num_batched_tokens=512,
                max_num_seqs=64, **ENGINE_DEVICE)
    return OmniEngineConfig.from_kwargs(**{**base, **kw})


def ask(part: dict, text: str) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def data_part(kind: str, data: bytes) -> dict:
    return {"type": f"{kind}_url", f"{kind}_url": {"url": "data:;base64," + base64.b64encode(data).decode()}}


ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def ttft(engine: OmniEngine, messages: list[dict], starts: list[float] | None = None) -> float:
    t0 = time.perf_counter()
    if starts is not None: starts.append(t0)  # noqa: E701  (when the clock started: bench_repeat's parts)
    async for d in engine.generate(messages, ONE_TOKEN):
        if d.new_token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token generated")
