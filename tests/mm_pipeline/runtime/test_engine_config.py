"""OmniEngineConfig contains the LLM engine's EngineConfig: every engine field is settable by its flat
name (from_kwargs, MultimodalLLM kwargs, the CLI), none is declared twice, an unknown name is a
TypeError that names it, and dtypes go through the one parser."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_core.engine.engine_config import EngineConfig
from mm_pipeline.cli import UsageError, build_parser, engine_config
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.runtime.config import OmniEngineConfig

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def test_engine_fields_live_in_the_engine_config_only():
    own = {f.name for f in dataclasses.fields(OmniEngineConfig)}
    assert not own & ENGINE_FIELDS  # nothing re-declared, so no flat name is ambiguous
    assert OmniEngineConfig().engine == EngineConfig()


def test_from_kwargs_splits_flat_names():
    cfg = OmniEngineConfig.from_kwargs(device="cpu", dtype="bf16", page_size=8, num_full_tokens=1024,
                                       swa_release_interval=4, kv_model_id="m@1", queue_wait_credit=5.0,
                                       queue_policy="fewest_uncached", max_queue=3, limits=MediaLimits(max_bytes=9))
    assert cfg.engine == EngineConfig(page_size=8, num_full_tokens=1024, swa_release_interval=4, kv_model_id="m@1",
                                      queue_wait_credit=5.0, queue_policy="fewest_uncached")
    assert (cfg.device, cfg.dtype, cfg.max_queue, cfg.limits.max_bytes) == ("cpu", "bf16", 3, 9)
    # flat engine names apply over an engine config given whole
    over = OmniEngineConfig.from_kwargs(engine=EngineConfig(page_size=32, max_num_seqs=7), max_num_seqs=2)
    assert (over.engine.page_size, over.engine.max_num_seqs) == (32, 2)


def test_every_engine_field_is_settable():
    for f in dataclasses.fields(EngineConfig):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        assert getattr(OmniEngineConfig.from_kwargs(**{f.name: value}).engine, f.name) == value


def test_unknown_field_and_bad_values():
    with pytest.raises(TypeError, match="'max_num_seq'.*did you mean 'max_num_seqs'"):
        OmniEngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match="'colour'"):
        OmniEngineConfig.from_kwargs(colour="blue")
    with pytest.raises(ValueError, match="memory_fraction"):
        OmniEngineConfig.from_kwargs(memory_fraction=2.0)  # EngineConfig validates its own fields
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        OmniEngineConfig(dtype="float8")
    assert OmniEngineConfig(dtype=torch.bfloat16).dtype is torch.bfloat16


def test_cli_flags_build_the_nested_config(tmp_path):
    args = build_parser().parse_args(["caption", str(tmp_path), "--device", "cpu", "--dtype", "bf16",
                                      "--kv-tokens", "2048", "--max-num-seqs", "3", "--enable-prefix-caching",
                                      "--max-queue", "5"])
    cfg = engine_config(args)
    assert (cfg.dtype, cfg.max_queue) == ("bf16", 5)
    assert (cfg.engine.num_full_tokens, cfg.engine.max_num_seqs, cfg.engine.enable_prefix_caching) == (2048, 3, True)
    with pytest.raises(SystemExit):  # argparse checks each value: a usage error naming --dtype
        build_parser().parse_args(["caption", str(tmp_path), "--device", "cpu", "--dtype", "int4"])
    both = build_parser().parse_args(["caption", str(tmp_path), "--allow-remote-media"])
    with pytest.raises(UsageError, match="allowed-domains"):  # fields checked together
        engine_config(both)


def test_decoder_threads_zero_shares_the_cpus_among_the_decode_workers(monkeypatch):
    """0 resolves per host: CPUs // decode workers, at least 1 (no codec threads when every CPU
    already runs a decode worker); an explicit count is kept, and it is what the planner gets."""
    import os

    from mm_pipeline.media.decode.decoder_memory import shared_codec_threads
    from mm_pipeline.media.decode.video_sampling import VideoSamplingParams

    for cpus, workers, want in ((2, 2, 1), (2, 1, 2), (16, 2, 8), (3, 4, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        cfg = OmniEngineConfig(decode_workers=workers)
        assert shared_codec_threads(workers) == cfg.resolved_decoder_threads == want
        assert cfg.planner_config(VideoSamplingParams()).decoder_threads == want
        assert OmniEngineConfig(decode_workers=workers, decoder_threads=3).resolved_decoder_threads == 3
    with pytest.raises(ValueError, match="decode workers"):
        shared_codec_threads(0)


def test_video_frame_factor_must_be_a_multiple_of_the_temporal_patch(tmp_path, capsys):
    """--video-frame-factor (video_sampling.frame_factor) against the checkpoint's vision
    temporal_patch_size (2 here). Before, a factor of 1 was taken: a one-frame video then planned no
    frame group and its request failed (HTTP 500), an odd frame count silently lost a frame. Now
    constructing the engine refuses it naming both numbers, before any weight is read (the CLI: a
    usage error, exit 2, as a bad flag); a multiple of the patch still runs."""
    from mm_pipeline import cli
    from mm_pipeline.multimodal_llm import MultimodalLLM
    from mm_pipeline.model.omni_model import OmniModel
    from mm_pipeline.runtime.components import OmniRuntime
    from mm_pipeline.runtime.config import CheckpointMismatchError
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint
    from tests.support.media_samples import video_bytes
    from llm_core import SamplingParams

    ckpt = build_tiny_omni_checkpoint(tmp_path / "m")
    engine = dict(page_size=4, num_full_tokens=4096, num_swa_tokens=2048)
    for bad in (1, 3):
        with pytest.raises(ValueError, match=rf"video_frame_factor \(--video-frame-factor\) {bad} is not a positive "
                                             rf"multiple of the checkpoint's vision temporal_patch_size 2"):
            MultimodalLLM(ckpt, video_frame_factor=bad, **engine)
    # a runtime built on a loaded model checks too, before it allocates anything (KV pools, threads)
    model = OmniModel.load(ckpt)
    with pytest.raises(CheckpointMismatchError, match="temporal_patch_size 2"):
        OmniRuntime(model, OmniEngineConfig.from_kwargs(video_frame_factor=1, **engine))
    assert cli.main(["serve", "--model", str(ckpt), "--device", "cpu", "--video-frame-factor", "1"]) == 2
    assert "--video-frame-factor) 1 is not a positive multiple" in capsys.readouterr().err
    # the checkpoint's own factor and its multiples run; a one-frame video is padded to a whole group
    (tmp_path / "one.mp4").write_bytes(video_bytes(n_frames=1))
    conv = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": (tmp_path / "one.mp4").as_uri()}},
                                         {"type": "text", "text": "Describe."}]}]
    for good in (2, 4):
        with MultimodalLLM(ckpt, video_frame_factor=good, allowed_local_dirs=(str(tmp_path),), **engine) as llm:
            (out,) = llm.chat([conv], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            assert out.error is None and out.finish_reason == "length", (good, out.error)
