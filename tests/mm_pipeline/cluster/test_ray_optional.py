"""Ray is optional: a plain ``mmserve caption`` run never imports it, and ``--ray`` flags are
checked before any cluster starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO, SAMPLE_MEDIA


def test_a_plain_caption_run_does_not_import_ray(tmp_path):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    model = build_tiny_omni_checkpoint(tmp_path / "tiny-omni", seed=0)
    out = tmp_path / "c.jsonl"
    code = ("import sys, torch; torch.set_num_threads(1)\n"
            "from mm_pipeline.cli import main\n"
            f"rc = main(['caption', {str(SAMPLE_MEDIA / 'image_000001.png')!r}, '--model', {str(model)!r}, "
            f"'--out', {str(out)!r}, '--max-tokens', '2', '--device', 'cpu', '--kv-tokens', '4096'])\n"
            "print('rc', rc, 'ray' in sys.modules, 'ray.data' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.stdout.strip().splitlines()[-1] == "rc 0 False False", done.stderr[-2000:]
    assert out.read_text().count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--ray", "more.png"], "is not a Ray address"),
    (["--ray", "--replicas", "0"], "replicas and batch_size must be >= 1"),
    (["--ray", "--cpus-per-replica", "0"], "cpus_per_replica must be > 0"),
    (["--ray", "--read-ahead-mb", "0"], "'0' is not a positive number of MiB"),
    (["--ray", "--read-ahead-mb", "inf"], "'inf' is not a positive number of MiB"),
    (["--ray", "--replica-start-timeout-s", "0"], "'0' is not a whole number of seconds >= 1"),
    (["--ray", "--replica-start-timeout-s", "1.5"], "'1.5' is not a whole number of seconds >= 1"),
    (["--format", "parquet"], "--format parquet needs --ray"),
])
def test_ray_flags_are_checked_before_anything_starts(argv, message, capsys, monkeypatch):
    from mm_pipeline.cli import main
    from tests.support.paths import DEMO_MODEL

    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("needs the demo model directory (only its config is read)")
    monkeypatch.setattr("mm_pipeline.cli.load_engine", lambda *a: pytest.fail("the engine must not load"))
    try:
        rc = main(["caption", str(SAMPLE_MEDIA / "image_000001.png"), *argv])
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("ray", [[], ["--ray"]])
def test_a_jsonl_caption_job_refuses_a_parquet_output(ray, tmp_path, capsys, monkeypatch):
    """``caption --ray`` without ``--format parquet`` replaced a Parquet output's rows with its own:
    refused (and without --ray too) before a model loads or a cluster starts."""
    from mm_pipeline.cli import main
    from tests.support.paths import DEMO_MODEL

    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("needs the demo model directory (only its config is read)")
    monkeypatch.setattr("mm_pipeline.cli.load_engine", lambda *a: pytest.fail("the engine must not load"))
    out = tmp_path / "c.parquet"
    out.write_bytes(b"PAR1" + bytes(8) + b"PAR1")
    rc = main(["caption", str(SAMPLE_MEDIA / "image_000001.png"), "--model", str(DEMO_MODEL), "--out", str(out), *ray])
    assert rc == 2 and "is a Parquet file; give --format parquet" in capsys.readouterr().err
    assert out.read_bytes() == b"PAR1" + bytes(8) + b"PAR1"


@pytest.mark.parametrize("argv, message", [
    (["caption", "x.png", "--replicas", "2"], "--replicas needs --ray"),
    (["caption", "x.png", "--batch-size", "4", "--gpus-per-replica", "1"], "--gpus-per-replica, --batch-size need --ray"),
    (["caption", "x.png", "--ray", "--concurrency", "4"], "--concurrency applies only without --ray"),
    (["batch", "-i", "a", "-o", "b", "--read-ahead-mb", "8"], "--read-ahead-mb needs --ray"),
    (["batch", "-i", "a", "-o", "b", "--replica-start-timeout-s", "60"], "--replica-start-timeout-s needs --ray"),
    (["batch", "-i", "a", "-o", "b", "--ray", "--concurrency", "4"], "--concurrency applies only without --ray"),
    (["serve", "--model", "m", "--llm-replicas", "4"], "--llm-replicas needs --ray"),
    (["serve", "--model", "m", "--router", "pow2"], "--router needs --ray"),
])
def test_a_flag_the_run_would_ignore_is_a_usage_error(argv, message, capsys):
    """Ray-only flags without --ray, and --concurrency with it, were accepted and ignored."""
    from mm_pipeline.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["caption", "x.png", "--concurrency", "4"], ["caption", "x.png", "--ray", "--replicas", "2"],
    ["caption", "x.png", "--replicas", "1"],  # a default value changes nothing: not refused
    ["batch", "-i", "a", "-o", "b", "--ray", "--batch-size", "4"], ["serve", "--model", "m", "--ray", "--router", "pow2"],
])
def test_flags_the_run_reads_are_taken(argv):
    from mm_pipeline.cli import parse_args

    assert parse_args(argv).command == argv[0]


def test_ray_options_come_from_a_config_file_too(tmp_path):
    from mm_pipeline.cli import parse_args

    cfg = tmp_path / "job.yaml"
    cfg.write_text("ray: auto\nreplicas: 3\ncpus-per-replica: 0.5\nformat: parquet\n")
    a = parse_args(["caption", "x.png", "--config", str(cfg)])
    assert (a.ray, a.replicas, a.cpus_per_replica, a.format) == ("auto", 3, 0.5, "parquet")
    cfg.write_text("ray: true\n")  # YAML's boolean: a local cluster, as a bare --ray
    assert parse_args(["caption", "x.png", "--config", str(cfg)]).ray == ""
    assert parse_args(["caption", "x.png", "--ray", "10.0.0.5:6379"]).ray == "10.0.0.5:6379"
    assert parse_args(["caption", "x.png"]).ray is None  # no --ray: the single-process job


def test_read_ahead_comes_from_the_command_line_or_a_config_file_for_both_jobs(tmp_path):
    """``--read-ahead-mb`` (MiB of inputs read ahead of each replica) reaches RayJobConfig for caption
    and batch alike; without it the job's own default applies (None here)."""
    from mm_pipeline.cli import parse_args
    from mm_pipeline.cluster.ray_commands import job_config

    caption = ["caption", "x.png", "--ray", "--replicas", "2"]
    batch = ["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--ray"]
    assert job_config(parse_args([*caption, "--read-ahead-mb", "256"])).read_ahead_bytes == 256 << 20
    assert job_config(parse_args([*batch, "--read-ahead-mb", "0.5"])).read_ahead_bytes == 1 << 19
    assert job_config(parse_args(caption)).read_ahead_bytes is None
    assert job_config(parse_args(batch)).read_ahead_bytes is None
    # how long the replicas may take to start (Ray Data's wait_for_min_actors_s)
    assert job_config(parse_args(caption)).start_timeout_s == 600
    assert job_config(parse_args([*batch, "--replica-start-timeout-s", "1800"])).start_timeout_s == 1800
    cfg = tmp_path / "job.yaml"
    cfg.write_text("ray: local\nread-ahead-mb: 64\n")
    config = job_config(parse_args(["caption", "x.png", "--config", str(cfg)]))
    assert config.read_ahead_bytes == 64 << 20 and config.object_store_bytes(1) == 64 << 20


def test_the_ray_read_stage_refuses_a_file_over_the_byte_limit_before_reading_it(tmp_path):
    """``caption --ray`` read every input whole in its read tasks (a 3 GiB file, 3 GiB of memory)
    before the engine's byte limit could refuse it; the limit now reaches the read stage."""
    pytest.importorskip("ray")
    import numpy as np

    from mm_pipeline.cluster.caption_dataset import read_batch

    big = tmp_path / "big.mp4"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # sparse: nothing is written, a read would fault in 3 GiB
    out = read_batch({"input": np.array(["big.mp4"]), "path": np.array([str(big)])}, max_bytes=1000)
    assert out["data"] == [b""] and "MediaTooLarge" in out["read_error"][0] and "limit 1000" in out["read_error"][0]


@pytest.mark.parametrize("command", ["caption", "batch"])
def test_a_ray_job_on_an_output_another_job_writes_fails_before_a_cluster_starts(command, tmp_path, capsys,
                                                                                 monkeypatch):
    """``--ray`` took no lock on its output: it now fails up front, with the single-process job's message."""
    from mm_pipeline.cli import main
    from mm_pipeline.jobs.resume import open_output
    from tests.support.paths import DEMO_MODEL

    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("needs the demo model directory (only its config is read)")
    monkeypatch.setattr("mm_pipeline.cluster.ray_runtime.connect", lambda *a: pytest.fail("no cluster may start"))
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a"}\n')
    out = tmp_path / "busy.jsonl"
    argv = ([str(SAMPLE_MEDIA / "image_000001.png"), "--out", str(out)] if command == "caption"
            else ["-i", str(src), "-o", str(out)])
    with open_output(out):  # a single-process job (or another --ray job) writes it
        assert main([command, *argv, "--model", str(DEMO_MODEL), "--ray"]) == 2
    assert "is being written by another job (it holds the file's lock)" in capsys.readouterr().err
