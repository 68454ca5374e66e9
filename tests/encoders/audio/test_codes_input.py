"""Pre-tokenized RVQ codes as encoder input (issue 23): the token rule for codes gives the counts of
the audio they are the codes of, for every clip length (the real geometry and the tiny one), and a
batch mixing mel segments and code segments gives each the rows it gets alone."""

from __future__ import annotations

import pytest
import torch

from encoders.audio.mimo_audio import MimoAudioEncoder
from encoders.config import AudioConfig, unit_tokens
from samples.checkpoints.tiny_towers import init_random_, tiny_audio_config, tiny_speech_config, tiny_tokenizer_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_real_geometry_cuts_codes_where_the_audio_is_cut():
    cfg = AudioConfig()  # 100 mel frames/s, stride 2, pool 2, group 4, 6000-frame segments
    assert cfg.code_frames_per_second == 25.0 and cfg.codes_per_segment == 1500
    assert cfg.codes_per_segment % cfg.group_size == 0  # so cutting codes never changes a group
    assert cfg.tokens_per_second == 6.25


@pytest.mark.parametrize("cfg", [AudioConfig(), tiny_audio_config(), tiny_audio_config(segment_size=90)],
                         ids=["real", "tiny", "23-code-segments"])
def test_codes_count_as_their_audio_for_every_length(cfg):
    """The tokenizer makes ``code_frames(n)`` codes of an n-frame segment; the concatenated codes
    of a clip, cut by codes_per_segment, give the clip's own token counts."""
    lengths = list(range(1, 3 * cfg.segment_size + 2)) if cfg.segment_size < 200 else \
        [1, 2, 3, 99, 100, 101, 5999, 6000, 6001, 12000, 12001, 60 * 6000 + 3]
    for mel_frames in lengths:
        full, rest = divmod(mel_frames, cfg.segment_size)
        codes = full * cfg.code_frames(cfg.segment_size) + (cfg.code_frames(rest) if rest else 0)
        assert unit_tokens("audio_codes", (codes,), audio=cfg) == unit_tokens("audio", (mel_frames,), audio=cfg)


def test_a_batch_of_mels_and_codes_gives_each_its_own_rows():
    enc = init_random_(MimoAudioEncoder(tiny_audio_config(), tiny_tokenizer_config(), tiny_speech_config()), 3).eval()
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(n, 32, generator=gen) for n in (96, 13)]
    codes = [torch.stack([torch.randint(0, size, (n,), generator=gen) for size in enc.codebook_sizes], 1).int()
             for n in (24, 5)]
    mel_rows, code_rows = enc.encode_segments_and_codes(mels, codes)
    for got, mel in zip(mel_rows, mels):
        torch.testing.assert_close(got, enc.encode_segments([mel])[0])
    for got, c in zip(code_rows, codes):
        torch.testing.assert_close(got, enc.encode_codes(c))
        assert got.shape[0] == -(-c.shape[0] // 4)
    assert enc.codebook_sizes == (16, 16, 8, 8)  # the tokenizer's codebooks of the 4 channels read
