"""Tiny random omni checkpoints (MiMo-V2.5 layout) for tests, benchmarks and the demo.

    out_dir/
      config.json                    model_type "mimo_v2" (hub text spelling) + vision_config,
                                     audio_config, processor_config, special token ids
      model-main.safetensors         text weights (samples.checkpoints.tiny_text.write_hub_layout)
      model-experts.safetensors      routed experts
      model-encoders.safetensors     visual.* and audio_encoder.* (+ speech_embeddings.* on the
                                     reference audio path)
      model.safetensors.index.json   weight_map over the three shards
      audio_tokenizer/               config.json + model.safetensors (encoder.*), reference path only
      tokenizer.json, tokenizer_config.json, chat_template.jinja   (AutoTokenizer loads these)

The tokenizer is byte-level BPE (ids 0..255 = bytes, so any text, "MM:SS" timestamps included,
encodes), then the special tokens of :class:`SpecialTokens` at 256.., then the non-special tags
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, then the merged tokens, if any (the
test checkpoints have none; the demo model's come from :func:`learn_bpe_merges` over its corpus).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from encoders.audio.encoder import AudioEncoder
from encoders.audio.rvq_tokenizer import AudioTokenizerEncoder
from encoders.audio.speech_input import SpeechInput
from samples.checkpoints.tiny_towers import (init_random_, tiny_audio_config, tiny_speech_config,
                                             tiny_tokenizer_config, tiny_vision_config)
from encoders.vision.tower import VisionTransformer
from encoders.weights import save_modules
from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint, write_hub_layout
from mm_pipeline.model.config import STRINGS, SpecialTokens

BYTE_VOCAB = 256
EXTRA_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
DEFAULT_SYSTEM = "You are MiMo, a helpful AI assistant engineered by Xiaomi."

# Qwen-style turns (docs/model.md §5.2); one pad per media item (PromptLayout expands it). No
# whitespace-control dashes: the string has no formatting whitespace, and a dash would eat the "\n"s.
CHAT_TEMPLATE = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is not none %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type in ['image', 'image_url'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type in ['video', 'video_url'] %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part.type in ['audio', 'input_audio', 'audio_url'] %}"
    "<|mimo_audio_start|><|audio_pad|><|mimo_audio_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if not messages or messages[0].role != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n<think>{{ message.reasoning_content or '' }}</think>{{ render(message.content) }}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ render(message.content) }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ render(message.content) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def tiny_special_tokens() -> SpecialTokens:
    """Special ids right after the 256 byte tokens, in :data:`STRINGS` order."""
    return SpecialTokens(**{name: BYTE_VOCAB + i for i, name in enumerate(STRINGS)})


def learn_bpe_merges(texts: Sequence[str], max_merges: int, min_count: int = 2) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from ``texts`` (greedy: most frequent adjacent pair first, ties
    broken by the pair itself, so the result is a pure function of the corpus)."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    counts = Counter(w for t in texts for w, _ in pre.pre_tokenize_str(t))
    words = {w: list(w) for w in counts}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter = Counter()
        for w, syms in words.items():
            for pair in zip(syms, syms[1:]):
                pairs[pair] += counts[w]
        if not pairs:
            break
        (a, b), n = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if n < min_count:
            break
        merges.append((a, b))
        for w, syms in words.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[w] = out
    return merges


def build_tiny_tokenizer(special: SpecialTokens, merges: Sequence[tuple[str, str]] = ()) -> Any:
    """A transformers fast tokenizer (byte-level BPE, see module doc) with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    by_id = sorted((tid, STRINGS[name]) for name, tid in special.as_dict().items())
    expected = list(range(BYTE_VOCAB, BYTE_VOCAB + len(by_id)))
    if [tid for tid, _ in by_id] != expected:
        raise ValueError(f"tiny tokenizer needs special ids {expected[0]}..{expected[-1]}, got {special}")
    # Specials and tags sit in the model vocab at fixed ids, so adding them below reuses those ids
    # and the merged tokens can follow them without shifting any special id.
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({s: tid for tid, s in by_id})
    vocab.update({t: expected[-1] + 1 + i for i, t in enumerate(EXTRA_TAGS)})
    for a, b in merges:
        if a not in vocab or b not in vocab:
            raise ValueError(f"merge {a!r} + {b!r} uses a token no earlier merge made")
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in by_id])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in EXTRA_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=STRINGS["im_end"], pad_token=STRINGS["pad"], chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[s for _, s in by_id if s not in (STRINGS["im_end"], STRINGS["pad"])],
    )


def processor_config(special: SpecialTokens, vision, audio, *, image_pixels: tuple[int, int] = (32 * 32, 128 * 128),
                     video_pixels: tuple[int, int] = (32 * 32, 64 * 64), video_total_max_pixels: int = 64 * 64 * 16,
                     fps: float = 1.0, min_frames: int = 2, max_frames: int = 16) -> dict[str, Any]:
    """A checkpoint's ``processor_config`` (the real MiMo-V2.5 field names and semantics) from the
    towers' configs and the pixel / frame budgets; the defaults are small so tiny-model tests stay fast."""
    return {
        "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "image_min_pixels": image_pixels[0], "image_max_pixels": image_pixels[1],
        "video_min_pixels": video_pixels[0], "video_max_pixels": video_pixels[1],
        "video_total_max_pixels": video_total_max_pixels,
        "fps": fps, "min_frames": min_frames, "max_frames": max_frames, "use_video_timestamps": True,
        "rope_type": "rope",
        "audio_sampling_rate": audio.sampling_rate, "audio_nfft": audio.n_fft, "audio_window_size": audio.window_size,
        "audio_hop_length": audio.hop_length, "audio_n_mels": audio.n_mels, "audio_fmin": audio.fmin,
        "audio_fmax": audio.fmax, "audio_kernel_size": audio.kernel_size, "audio_stride_size": audio.stride_size,
        "audio_avg_pooler": audio.avg_pooler, "audio_group_size": audio.group_size,
        "audio_segment_size": audio.segment_size,
        **{k: v for k, v in special.to_config().items() if k not in ("eos_token_id", "pad_token_id")},
        "pad_token_id": special.pad,
    }


def build_tiny_omni_checkpoint(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny omni checkpoint (see module doc) into ``out_dir``; returns it.

    ``overrides``: ``vision_config`` / ``audio_config`` (dicts of field overrides for
    :func:`samples.checkpoints.tiny_towers.tiny_vision_config` / ``tiny_audio_config``), ``fp8`` (bool, FP8 text
    weights), ``audio_path`` ("ours", default, or "reference": the MiMo-V2.5 RVQ audio path in the real
    tensor layout, docs/model.md §2.4, scaled down by ``tiny_tokenizer_config`` / ``tiny_speech_config``
    with ``tokenizer_config`` / ``speech_config`` overrides), anything else goes to the tiny text config
    (samples.checkpoints.tiny_text).
    """
    out = Path(out_dir)
    vision_over = dict(overrides.pop("vision_config", None) or {})
    audio_over = dict(overrides.pop("audio_config", None) or {})
    fp8 = bool(overrides.pop("fp8", False))
    audio_path = overrides.pop("audio_path", "ours")
    tokenizer_over = dict(overrides.pop("tokenizer_config", None) or {})
    speech_over = dict(overrides.pop("speech_config", None) or {})
    if audio_path not in ("ours", "reference"):
        raise ValueError(f"audio_path must be 'ours' or 'reference', got {audio_path!r}")
    special = tiny_special_tokens()
    text_over = {"eos_token_id": special.im_end, "pad_token_id": special.pad, "bos_token_id": None, **overrides}
    with tempfile.TemporaryDirectory() as tmp:
        write_hub_layout(build_tiny_hf_checkpoint(Path(tmp) / "hf", seed=seed, **text_over), out, fp8=fp8)
    cfg = json.loads((out / "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    vision_cfg = tiny_vision_config(**{"out_hidden_size": hidden, **vision_over})
    audio_cfg = tiny_audio_config(**{"out_hidden_size": hidden, **audio_over})
    vision = init_random_(VisionTransformer(vision_cfg), seed + 1)
    shard = "model-encoders.safetensors"
    modules = {"visual.": vision}
    if audio_path == "ours":
        modules["audio_encoder."] = init_random_(AudioEncoder(audio_cfg), seed + 2)
        audio_config = audio_cfg.to_dict()
    else:
        speech_cfg = tiny_speech_config(**{"out_hidden_size": hidden, "group_size": audio_cfg.group_size,
                                           **speech_over})
        tok_cfg = tiny_tokenizer_config(**{"n_mels": audio_cfg.n_mels, **tokenizer_over})
        speech = init_random_(SpeechInput(speech_cfg), seed + 2)
        modules.update({"speech_embeddings.": speech.speech_embeddings, "audio_encoder.": speech.audio_encoder})
        (out / "audio_tokenizer").mkdir(parents=True, exist_ok=True)
        save_modules(out / "audio_tokenizer" / "model.safetensors",
                     {"encoder.": init_random_(AudioTokenizerEncoder(tok_cfg), seed + 3)})
        (out / "audio_tokenizer" / "config.json").write_text(json.dumps(tok_cfg.to_dict(), indent=2))
        # the hub spelling: the speech fields, plus the segment size (front end: processor_config)
        audio_config = {**speech_cfg.to_dict(), "audio_segment_size": audio_cfg.segment_size}
    save_modules(out / shard, modules)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for prefix, module in modules.items():
        index["weight_map"].update({f"{prefix}{n}": shard for n in module.state_dict()})
    index_path.write_text(json.dumps(index, indent=1))

    cfg.update(special.to_config())
    cfg.update({
        "vision_model_type": "mimovl",
        "vision_config": vision_cfg.to_dict(),
        "audio_config": audio_config,
        "processor_config": processor_config(special, vision_cfg, audio_cfg),
    })
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tiny_tokenizer(special).save_pretrained(str(out))
    return out
