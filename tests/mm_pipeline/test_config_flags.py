"""CLI flags generated from the config dataclasses (mm_pipeline/config_flags.py): every field has a
flag with help text, flags round-trip into the config, bad values are usage errors naming the flag,
``--config FILE`` (YAML and JSON) gives defaults that explicit flags override."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Literal

import pytest

from llm_core.engine.engine_config import EngineConfig
from mm_pipeline import cli
from mm_pipeline.config_flags import add_config_flags, config_flags, config_values, field_docs, parse_scalar
from mm_pipeline.media.ingest_config import MediaLimits
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams
from mm_pipeline.runtime.config import OmniEngineConfig
from mm_pipeline.server.launch.serve_settings import server_settings

NESTED = {"engine", "limits", "video_sampling"}


def _config(argv: list[str]) -> OmniEngineConfig:
    return cli.engine_config(cli.parse_args(argv))


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_field_of_every_config_has_a_flag_with_help(tmp_path):
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    options = {f.option for f in config_flags()}
    expected = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)}
    expected |= {"--" + f.name.replace("_", "-") for f in dataclasses.fields(OmniEngineConfig) if f.name not in NESTED}
    expected |= {"--media-" + f.name.replace("_", "-") for f in dataclasses.fields(MediaLimits)}
    expected |= {"--video-" + f.name.replace("_", "-") for f in dataclasses.fields(VideoSamplingParams)}
    assert options == expected
    for cls in (EngineConfig, OmniEngineConfig, MediaLimits, VideoSamplingParams):
        missing = [f.name for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    for flag in config_flags():
        assert flag.option in help_text
        assert flag.doc.split()[0] in help_text
    for sub in ("caption", "batch"):  # the same flags on every command that builds an engine
        argv = [sub, str(tmp_path)] if sub == "caption" else [sub, "-i", "x", "-o", "y"]
        assert cli.parse_args(argv + ["--max-num-seqs", "3"]).config__max_num_seqs == 3


def test_vllm_spellings_set_the_same_fields(tmp_path):
    assert _config(["caption", str(tmp_path), "--quantization", "fp8"]).engine.fp8_experts is True
    assert _config(["caption", str(tmp_path), "-q", "fp8", "--enforce-eager"]).engine.compile_decode is False
    assert _config(["caption", str(tmp_path)]).engine.fp8_experts is None  # left out: the default rule


def test_flags_round_trip_into_the_config(tmp_path):
    cfg = _config(["caption", str(tmp_path), "--device", "cpu", "--page-size", "8", "--num-swa-tokens", "256",
                   "--memory-fraction", "0.25", "--max-chunk-tokens", "64", "--swa-release-interval", "4",
                   "--queue-policy", "fewest_uncached", "--kv-host-bytes", "64MiB", "--kv-store", str(tmp_path),
                   "--no-stream-embeddings", "--media-max-pixels", "1000", "--media-max-bytes", "2M",
                   "--video-fps", "2", "--video-max-frames", "16", "--allowed-local-dirs", "/a",
                   "--allowed-local-media-path", "/b", "--decode-admit-timeout-s", "1.5",
                   "--max-model-len", "none", "--enable-prefix-caching"])
    e = cfg.engine
    assert (e.page_size, e.num_swa_tokens, e.memory_fraction, e.max_chunk_tokens, e.swa_release_interval) == \
        (8, 256, 0.25, 64, 4)
    assert (e.queue_policy, e.kv_host_bytes, e.kv_store, e.max_model_len, e.enable_prefix_caching) == \
        ("fewest_uncached", 64 << 20, str(tmp_path), None, True)
    assert cfg.limits == MediaLimits(max_pixels=1000, max_bytes=2 << 20)
    assert cfg.video_sampling == VideoSamplingParams(fps=2.0, max_frames=16)
    assert (cfg.stream_embeddings, cfg.allowed_local_dirs, cfg.decode_admit_timeout_s) == (False, ("/a", "/b"), 1.5)
    # flags left out keep the dataclass defaults
    plain = _config(["caption", str(tmp_path), "--device", "cpu"])
    assert plain == OmniEngineConfig.from_kwargs(device="cpu", dtype="float32")
    # the old spellings still work
    old = _config(["caption", str(tmp_path), "--device", "cpu", "--kv-tokens", "2048", "--max-media-mb", "1",
                   "--encoder-cache-dir", str(tmp_path), "--allow-remote-media", "--allowed-media-domain", "x.org"])
    assert (old.engine.num_full_tokens, old.limits.max_bytes, old.cache_dir) == (2048, 1 << 20, str(tmp_path))
    assert (old.allow_http, old.allowed_domains) == (True, ("x.org",))
    # vLLM's spelling of the priority policy
    assert _config(["caption", str(tmp_path), "--scheduling-policy", "priority"]).engine.queue_policy == "priority"


@pytest.mark.parametrize("argv, flag", [
    (["--max-num-seqs", "many"], "--max-num-seqs"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),  # EngineConfig's own check, through the flag
    (["--memory-fraction", "2"], "--memory-fraction"),
    (["--media-max-bytes", "-5"], "--media-max-bytes"),
    (["--video-fps", "0"], "--video-fps"),
    (["--queue-policy", "random"], "--queue-policy"),
    (["--redis-url", "http://x"], "--redis-url"),
    (["--kv-host-bytes", "lots"], "--kv-host-bytes"),
    (["--max-num-seq", "4"], "unrecognized arguments: --max-num-seq"),  # no abbreviations either
])
def test_bad_values_are_usage_errors_naming_the_flag(argv, flag, tmp_path, capsys):
    err = _usage_error(["caption", str(tmp_path), *argv], capsys)
    assert flag in err and "usage:" in err


def test_flags_config_keys_and_python_kwargs_are_one_set_of_names():
    flat = {f.flat for f in config_flags()}
    assert "media_max_bytes" in flat and "video_fps" in flat and "max_num_seqs" in flat
    cfg = OmniEngineConfig.from_kwargs(media_max_pixels=5, video_fps=3.0, video_max_frames=16, max_num_seqs=2,
                                       limits=MediaLimits(max_bytes=7))
    assert cfg.limits == MediaLimits(max_bytes=7, max_pixels=5)  # flat names over a config given whole
    assert cfg.video_sampling == VideoSamplingParams(fps=3.0, max_frames=16)
    with pytest.raises(TypeError, match="did you mean 'media_max_bytes'"):
        OmniEngineConfig.from_kwargs(media_max_byte=1)


def test_cross_field_errors_are_usage_errors(tmp_path):
    # each value alone is fine; the combination is refused (mmserve exits 2 on a UsageError)
    with pytest.raises(cli.UsageError, match="--allowed-domains"):
        _config(["caption", str(tmp_path), "--device", "cpu", "--allow-http"])
    with pytest.raises(cli.UsageError, match="min_frames"):
        _config(["caption", str(tmp_path), "--device", "cpu", "--video-min-frames", "9", "--video-max-frames", "8"])


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_config_file_gives_defaults_and_explicit_flags_win(suffix, tmp_path):
    values = {"max_num_seqs": 5, "max-model-len": 300, "enable_prefix_caching": True, "stream_embeddings": False,
              "allowed_local_dirs": ["/x", "/y"], "media_max_pixels": 77, "kv_host_bytes": "1GiB",
              "kv_tokens": 512, "port": 9001, "decode_admit_timeout_s": None}
    path = tmp_path / f"cfg.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(values))
    else:
        import yaml

        path.write_text(yaml.safe_dump(values))
    args = cli.parse_args(["serve", "--model", "m", "--config", str(path), "--max-num-seqs", "2",
                           "--allowed-local-dirs", "/z", "--no-enable-prefix-caching"])
    cfg = cli.engine_config(args)
    assert args.port == 9001  # command options come from the file too
    assert (cfg.engine.max_num_seqs, cfg.engine.max_model_len, cfg.engine.enable_prefix_caching) == (2, 300, False)
    assert (cfg.stream_embeddings, cfg.allowed_local_dirs, cfg.limits.max_pixels) == (False, ("/z",), 77)
    assert (cfg.engine.kv_host_bytes, cfg.engine.num_full_tokens, cfg.decode_admit_timeout_s) == (1 << 30, 512, None)


def test_config_file_errors_name_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seq: 4\n")
    err = _usage_error(["caption", str(tmp_path), "--config", str(bad)], capsys)
    assert "unknown key 'max_num_seq'" in err and "max_num_seqs" in err
    bad.write_text("max_num_seqs: lots\n")
    assert "--max-num-seqs" in _usage_error(["caption", str(tmp_path), "--config", str(bad)], capsys)
    bad.write_text("enable_prefix_caching: 3\n")
    assert "'enable_prefix_caching' must be true or false" in _usage_error(
        ["caption", str(tmp_path), "--config", str(bad)], capsys)
    bad.write_text("- a list\n")
    assert "must hold a mapping" in _usage_error(["caption", str(tmp_path), "--config", str(bad)], capsys)
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    assert "not valid JSON" in _usage_error(["caption", str(tmp_path), "--config", str(broken)], capsys)
    assert "config file" in _usage_error(["caption", str(tmp_path), "--config", str(tmp_path / "none.yaml")], capsys)


def test_config_file_gives_required_options_and_ray_false(tmp_path, capsys):
    """batch's required --input/--output may come from the file alone (they were refused as missing
    before the file was read); ``ray: false`` leaves --ray off (it was "'False' is not a Ray address")."""
    path = tmp_path / "job.yaml"
    path.write_text("input: in.jsonl\noutput: out.jsonl\nray: false\nconcurrency: 4\n")
    args = cli.parse_args(["batch", "--config", str(path), "-o", "mine.jsonl"])
    assert (args.input, args.output, args.ray, args.concurrency) == ("in.jsonl", "mine.jsonl", None, 4)
    path.write_text("ray: false\n")
    assert cli.parse_args(["caption", "x.png", "--config", str(path)]).ray is None
    assert "required: -i/--input, -o/--output" in _usage_error(["batch", "--config", str(path)], capsys)
    path.write_text("concurrency: 0\n")  # the job settings' checks hold for the file's values too
    assert "argument --concurrency: concurrency must be >= 1" in _usage_error(
        ["batch", "-i", "a", "-o", "b", "--config", str(path)], capsys)


def test_sizes_parse_with_binary_suffixes():
    assert [parse_scalar(int, t, size=True) for t in ("123", "4K", "8GiB", "1.5M", "2mb")] == \
        [123, 4096, 8 << 30, 3 << 19, 2 << 20]
    with pytest.raises(ValueError, match="size like 8GiB"):
        parse_scalar(int, "8 parsecs", size=True)


@dataclasses.dataclass(frozen=True)
class Part:
    mode: Literal["fast", "exact"] = "fast"
    """How to run."""
    hosts: tuple[str, ...] = ()
    """Hosts (repeatable)."""
    limit: float | None = None
    """A limit."""


@dataclasses.dataclass(frozen=True)
class Root:
    engine: Part = dataclasses.field(default_factory=Part)
    """The part (flat names, as OmniEngineConfig.engine)."""
    verbose: bool = False
    """Say more."""


def test_generated_types_cover_literals_optionals_and_tuples():
    flags = config_flags(Root, {"engine": ""})
    assert [f.option for f in flags] == ["--mode", "--hosts", "--limit", "--verbose"]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(p, flags)
    ns = p.parse_args(["--mode", "exact", "--hosts", "a", "--hosts", "b", "--limit", "none", "--verbose"])
    assert config_values(ns, flags) == {"mode": "exact", "hosts": ("a", "b"), "limit": None, "verbose": True}
    assert config_values(p.parse_args([]), flags) == {}  # left out: the dataclass defaults apply
    with pytest.raises(argparse.ArgumentError, match="expected one of fast, exact"):
        p.parse_args(["--mode", "slow"])


def test_server_request_limits_are_flags_and_config_keys(tmp_path, capsys):
    """``mmserve serve``'s request limits (ServerSettings) are flags under their field names, read
    from ``--config`` too; a bad value is a usage error naming the flag."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"max_json_values": 5000, "max_request_bytes": "2MiB", "max_files": 3,
                                "max_json_objects": 4096}))
    args = cli.parse_args(["serve", "--model", "m", "--config", str(path), "--max-files", "7",
                           "--max-completion-prompts", "4", "--max-files-total-bytes", "1GiB",
                           "--max-background-responses", "3"])
    settings = server_settings(args, tmp_path)
    assert (settings.max_json_values, settings.max_request_bytes, settings.max_files) == (5000, 2 << 20, 7)
    assert settings.max_json_objects == 4096 and settings.json_limits.max_objects == 4096
    flagged = server_settings(cli.parse_args(["serve", "--model", "m", "--max-json-objects", "100000",
                                                  "--request-body-idle-s", "5"]), tmp_path)
    assert flagged.json_limits.max_objects == 100_000 and flagged.request_body_idle_s == 5.0
    assert (settings.max_completion_prompts, settings.max_files_total_bytes) == (4, 1 << 30)
    assert settings.max_background_responses == 3
    defaults = server_settings(cli.parse_args(["serve", "--model", "m"]), tmp_path)
    assert (defaults.max_json_values, defaults.max_files_total_bytes) == (4_000_000, 8 << 30)
    assert defaults.max_json_objects == 65_536 and defaults.request_body_idle_s == 60.0
    assert defaults.max_background_responses == 64
    for argv, flag in [(["--max-json-values", "10"], "--max-json-values"),
                       (["--max-json-objects", "10"], "--max-json-objects"),
                       (["--request-body-idle-s", "0"], "--request-body-idle-s"),
                       (["--max-request-bytes", "lots"], "--max-request-bytes"),
                       (["--max-completion-prompts", "0"], "--max-completion-prompts"),
                       (["--max-background-responses", "0"], "--max-background-responses")]:
        err = _usage_error(["serve", "--model", "m", *argv], capsys)
        assert flag in err and "usage:" in err
    audio = server_settings(cli.parse_args(["serve", "--model", "m", "--max-audio-upload-bytes", "8MiB",
                                                "--transcription-prompt", "Write down what is said."]), tmp_path)
    assert (audio.max_audio_upload_bytes, audio.transcription_prompt) == (8 << 20, "Write down what is said.")
    assert defaults.max_audio_upload_bytes == 25 << 20
    with pytest.raises(cli.UsageError, match="max_upload_bytes"):  # an upload larger than the whole store
        server_settings(cli.parse_args(["serve", "--model", "m", "--max-upload-mb", "2048",
                                            "--max-files-total-bytes", "1GiB"]), tmp_path)
    # a combination is checked on the whole settings, never one flag against the others' defaults:
    # a store smaller than the default upload limit is fine with a smaller upload limit given too
    small = server_settings(cli.parse_args(["serve", "--model", "m", "--max-upload-mb", "8",
                                                "--max-files-total-bytes", "256MiB"]), tmp_path)
    assert (small.max_upload_bytes, small.max_files_total_bytes) == (8 << 20, 256 << 20)
    with pytest.raises(cli.UsageError, match="max_upload_bytes"):  # alone, with the 512 MiB default upload
        server_settings(cli.parse_args(["serve", "--model", "m", "--max-files-total-bytes", "256MiB"]), tmp_path)
    assert "--max-audio-upload-bytes" in _usage_error(["serve", "--model", "m", "--max-audio-upload-bytes", "0"], capsys)


def test_config_file_values_starting_with_a_dash(tmp_path):
    """A value starting with ``-`` is the option's value, not taken for an option ("expected one
    argument" before): a key, a prompt, an entry of a repeated option."""
    path = tmp_path / "dash.yaml"
    path.write_text('api_key: "-secret123"\nallowed_origins: ["-odd"]\nmax_num_seqs: 4\n')
    args = cli.parse_args(["serve", "--model", "m", "--config", str(path)])
    assert (args.api_key, args.config__allowed_origins, args.config__max_num_seqs) == ("-secret123", ["-odd"], 4)
    path.write_text('prompt: "-terse"\n')
    assert cli.parse_args(["caption", "x.png", "--config", str(path)]).prompt == "-terse"


def test_config_file_many_valued_entry_starting_with_a_dash_names_the_file(tmp_path, capsys):
    """--served-model-name takes several tokens, so "-x" cannot ride as ``--opt=value``: the file's
    key is named rather than argparse's "expected at least one argument" for the flag."""
    path = tmp_path / "names.yaml"
    path.write_text('served_model_name: ["ok", "-x"]\n')
    err = _usage_error(["serve", "--model", "m", "--config", str(path)], capsys)
    assert f"config file {path}" in err and "'served_model_name' values cannot start with '-'" in err
    path.write_text('served_model_name: ["a", "b"]\n')
    assert cli.parse_args(["serve", "--model", "m", "--config", str(path)]).served_model_name == ["a", "b"]


@pytest.mark.parametrize("argv", [["-v", "serve", "--model", "m"], ["serve", "--model", "m", "-v"],
                                  ["caption", "x.png", "--verbose"], ["batch", "-i", "a", "-o", "b", "-v"]])
def test_verbose_before_or_after_the_command(argv):
    assert cli.parse_args(argv).verbose is True
    assert cli.parse_args([a for a in argv if a not in ("-v", "--verbose")]).verbose is False
