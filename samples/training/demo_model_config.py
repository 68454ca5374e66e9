"""The demo model's shape: MiMo-V2.5 layout at tiny scale, sized for the synthetic caption task.

Token budget per item (what the processor limits below give):

    image   256x256..320x320 px   -> <= 20x20 patches -> <= 100 LLM tokens (small images are
            upscaled: a shape is 0.2 x the short side, so a 100x535 image keeps ~25 px shapes)
    video   fps 2, pairs of frames = 1 group per second up to 30 s, then <= 60 frames spread over
            the video; <= 160x160 px per frame (25 tokens / group) at any length:
            60 s -> 30 groups x ("MM:SS" 5 + <vs> + 25 pads + <ve>) ~ 960 tokens
    audio   16 kHz, hop 160 (100 mel frames / s) -> conv stride 2 -> pool 2 -> groups of 2
            = 12.5 tokens / s (80 ms per token; beeps >= 150 ms, gaps >= 100 ms)

Text layers: [full, sliding, sliding, full, sliding, full]. The sliding layers see 32 tokens (well
below a 60 s video's ~960), so only the full-attention layers carry the first colours of a long
video to the answer. Six layers rather than four because a colour sequence needs three steps in
order: see a change between neighbouring groups (sliding), count the changes so far (full), and
fetch "segment j" while the j-th colour is written (full).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from encoders.config import AudioConfig, VisionConfig
from samples.checkpoints.tiny_omni import processor_config
from mm_pipeline.model.config import SpecialTokens

HIDDEN = 128


@dataclass(frozen=True)
class DemoModelConfig:
    """Everything that fixes the demo checkpoint's architecture and preprocessing."""

    text: dict[str, Any] = field(default_factory=lambda: dict(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
        num_attention_heads=4, num_key_value_heads=1,  # sliding layers get 2x (HF / hub convention)
        head_dim=32, v_head_dim=32, sliding_window=32,  # HF counts the query: 32 keys incl. itself
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
        attention_dropout=0.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        },
    ))
    vision: VisionConfig = VisionConfig(
        depth=4, hidden_size=96, intermediate_size=192, num_heads=4, num_key_value_heads=2, head_dim=24,
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=HIDDEN,
        fullatt_block_indexes=(0, 3), vit_window_attn_types=(-1, 0, 1, -1), window=16, use_sink=True)
    audio: AudioConfig = AudioConfig(
        sampling_rate=16000, n_fft=400, window_size=400, hop_length=160, n_mels=40, fmin=0.0, fmax=8000.0,
        kernel_size=3, stride_size=2, d_model=64, num_layers=2, num_heads=4, ffn_dim=128,
        layer_types=("sliding", "full"), attention_window=16, avg_pooler=2, group_size=2, segment_size=3000,
        projection_hidden_size=128, out_hidden_size=HIDDEN)
    # Images are brought to about one size: what limits accuracy is the pixel size of the smallest
    # shape (0.2 x the short side; in a 96x640 image ~0.08 x sqrt(area)), not the token count.
    image_min_pixels: int = 256 * 256
    image_max_pixels: int = 320 * 320
    video_min_pixels: int = 32 * 32
    video_max_pixels: int = 160 * 160
    video_total_max_pixels: int = 160 * 160 * 30  # x2 / frames: 60 frames -> 160x160 each
    # Every colour segment gets >= 2 sampled frames: a segment is D / k >= 1 s long, so fps 2 covers
    # videos up to 30 s; beyond that 60 frames spread over D give 60 / k >= 15 per segment (k <= 4).
    # Capping frames (not pixels) keeps a 60 s video at 160x160 frames: the shapes stay >= 2 patches.
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 60
    # Text layers whose outputs are asked (training only, samples.training.aux_targets) for the
    # circuit a colour sequence needs: sliding layers 1-2 see a group change colour (change_layer),
    # full layer 3 counts the changes before each group (ordinal_layer), and full layer 5 fetches
    # "segment j" while the j-th colour is written.
    ordinal_layer: int = 3
    change_layer: int = 2

    def __post_init__(self) -> None:
        for name in ("vision", "audio"):
            out = getattr(self, name).out_hidden_size
            if out != self.text["hidden_size"]:
                raise ValueError(f"{name} out_hidden_size {out} != text hidden_size {self.text['hidden_size']}")
        if self.max_frames < 2 or self.fps <= 0:
            raise ValueError(f"need fps > 0 and max_frames >= 2, got {self.fps}, {self.max_frames}")

    def processor_config(self, special: SpecialTokens) -> dict[str, Any]:
        """The checkpoint's ``processor_config`` (real MiMo-V2.5 field names)."""
        return processor_config(special, self.vision, self.audio,
                                image_pixels=(self.image_min_pixels, self.image_max_pixels),
                                video_pixels=(self.video_min_pixels, self.video_max_pixels),
                                video_total_max_pixels=self.video_total_max_pixels, fps=self.fps,
                                min_frames=self.min_frames, max_frames=self.max_frames)
