"""Audio encoders: seconds of audio encoded per second, our encoder vs the MiMo-V2.5 reference path
(from log-mel, and from the RVQ codes of the same clips, as pre-tokenized input skips the tokenizer),
all clips in one batched call vs one clip per call.

    .venv/bin/python benchmarks/audio_encoders.py --quick --json /tmp/audio_encoders.json

Both encoders get the same log-mel segments (the front end is shared and excluded: encoder device
work only) of clips of mixed lengths, fp32 on CPU, random weights at a mid size where matmuls, not
Python, dominate: width 512, 8 transformer layers each (ours: sliding/full alternating; the
reference tokenizer: causal, sliding/full alternating, 20-stage RVQ, then a 2-layer local
transformer of width 512 and the projection to 1024). ``--real`` uses the MiMo-V2.5 sizes
(width 1024, 24 tokenizer layers, 6 local layers, LLM width 4096; slow on CPU). Times are medians.
"""

from __future__ import annotations

import _bench_bootstrap  # noqa: F401  (first: the repository root leads sys.path)

import random
import statistics
import time
from typing import Callable

import torch

from _common import base_parser, print_table, write_json
from encoders.audio.encoder import AudioEncoder
from encoders.audio.mimo_audio import MimoAudioEncoder
from encoders.audio.mimo_config import AudioTokenizerConfig, SpeechInputConfig
from encoders.audio.packing import split_segments
from encoders.config import AudioConfig
from samples.checkpoints.tiny_towers import init_random_


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def encoders(real: bool) -> dict[str, torch.nn.Module]:
    if real:
        front = AudioConfig()
        tok, speech = AudioTokenizerConfig(), SpeechInputConfig()
    else:
        front = AudioConfig(d_model=512, num_layers=8, num_heads=8, ffn_dim=2048, layer_types=("sliding", "full") * 4,
                            projection_hidden_size=2048, out_hidden_size=1024)
        tok = AudioTokenizerConfig(d_model=512, encoder_layers=8, encoder_attention_heads=8, encoder_ffn_dim=2048)
        speech = SpeechInputConfig(input_local_dim=512, input_local_layers=2, input_local_attn_heads=8,
                                   input_local_intermediate_size=2048, projection_hidden_size=2048,
                                   out_hidden_size=1024)
    ours = init_random_(AudioEncoder(front), 0).eval()
    reference = init_random_(MimoAudioEncoder(front, tok, speech), 1).eval()
    return {"ours": ours, "reference": reference}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true", help="MiMo-V2.5 sizes (slow on CPU)")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    seconds = [rng.uniform(2, 6) for _ in range(4)] if args.quick else [rng.uniform(2, 20) for _ in range(8)]
    reps = args.reps or (2 if args.quick else 3)
    cfg = AudioConfig()
    clips = [torch.randn(cfg.num_mel_frames(int(s * cfg.sampling_rate)), cfg.n_mels) for s in seconds]
    total_s = sum(seconds)
    rows, results = [], {"audio_seconds": round(total_s, 2), "clips": len(clips), "reps": reps}
    with torch.inference_mode():
        for name, enc in encoders(args.real).items():
            segments = [split_segments(c, cfg.segment_size) for c in clips]
            flat = [s for seg in segments for s in seg]
            enc.encode_segments(flat[:1])  # warm-up
            batched = median_time(lambda: enc.encode_segments(flat), reps)
            single = median_time(lambda: [enc.encode_segments(seg) for seg in segments], reps)
            timed = [(name, batched, single)]
            if isinstance(enc, MimoAudioEncoder):  # the same clips as pre-tokenized codes
                codes = [enc.tokenize_segments(seg) for seg in segments]
                flat_codes = [c for cs in codes for c in cs]
                timed.append(("reference_from_codes", median_time(lambda: enc.encode_codes_batch(flat_codes), reps),
                              median_time(lambda: [enc.encode_codes_batch(cs) for cs in codes], reps)))
            for path, batched, single in timed:
                rows.append([path, total_s / batched, total_s / single, single / batched])
                results.update({f"{path}_batched_audio_s_per_s": round(total_s / batched, 2),
                                f"{path}_one_by_one_audio_s_per_s": round(total_s / single, 2),
                                f"{path}_batch_speedup": round(single / batched, 3)})
    print_table(f"audio encoders: {len(clips)} clips, {total_s:.1f} s of audio, fp32 CPU, median of {reps}"
                f"{' (MiMo-V2.5 sizes)' if args.real else ''}",
                ["path", "batched audio s/s", "one-by-one audio s/s", "batch speed-up"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
