"""``mmserve caption``: input discovery, progress output, and (with a tiny omni checkpoint) a real
run over a folder with broken files, resumed."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from mm_pipeline.jobs.caption import already_done, discover_inputs
from mm_pipeline.jobs.progress import Progress


# ---- discovery ----------------------------------------------------------------------------------
def _touch(p: Path, data: bytes = b"x") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_discover_dirs_globs_lists(tmp_path):
    a = _touch(tmp_path / "d" / "a.png")
    b = _touch(tmp_path / "d" / "sub" / "b.mp4")
    _touch(tmp_path / "d" / "labels.jsonl", b"{}")  # metadata next to media: skipped in scans
    _touch(tmp_path / "d" / ".hidden.png")
    c = _touch(tmp_path / "e" / "c.wav")
    (tmp_path / "list.txt").write_text(f"# comment\n\n{c}\ne/c.wav\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"input": "d/a.png"}) + "\n" + json.dumps("e/c.wav") + "\n")
    assert discover_inputs([str(tmp_path / "d")]) == [str(a), str(b)]
    assert discover_inputs([str(tmp_path / "d" / "**" / "*.mp4")]) == [str(b)]
    # the same file through two specs is one input; order is first appearance
    assert discover_inputs([str(tmp_path / "list.txt"), str(tmp_path / "e")]) == [str(c)]
    assert discover_inputs([str(tmp_path / "list.jsonl")]) == [str(a), str(c)]
    missing = str(tmp_path / "nope.png")
    assert discover_inputs([missing]) == [missing]  # reported as a failed input, not dropped
    # a name with glob characters that matches nothing is a missing input too, not the job's end
    assert discover_inputs([str(tmp_path / "photo[1].png"), str(c)]) == [str(tmp_path / "photo[1].png"), str(c)]
    (tmp_path / "LIST.JSONL").write_text(json.dumps({"input": "e/c.wav"}) + "\n")  # the suffix in any case
    assert discover_inputs([str(tmp_path / "LIST.JSONL")]) == [str(c)]
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        discover_inputs([str(tmp_path / "bad.jsonl")])
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")  # a RecursionError traceback before
    with pytest.raises(ValueError, match="deep.jsonl:1: not JSON"):
        discover_inputs([str(tmp_path / "deep.jsonl")])


def test_lists_split_on_newlines_only(tmp_path):
    """A list was read with str.splitlines: a name (or a JSON string) holding U+2028 or U+0085 was cut
    in two (a wrong path, or "not JSON" for the whole run).  CRLF and a last line without its newline
    work, and a name that is not UTF-8 is the file os.walk would name."""
    names = ["a\u2028b.png", "c\x85d.png", "e.png"]
    (tmp_path / "list.txt").write_bytes("\r\n".join(["# comment", *names]).encode())
    (tmp_path / "list.jsonl").write_bytes("\r\n".join(json.dumps({"input": n}, ensure_ascii=False)
                                                       for n in names).encode())
    expect = [str(tmp_path / n) for n in names]
    assert discover_inputs([str(tmp_path / "list.txt")]) == expect
    assert discover_inputs([str(tmp_path / "list.jsonl")]) == expect
    (tmp_path / "raw.txt").write_bytes(b"caf\xe9.png\n")
    assert discover_inputs([str(tmp_path / "raw.txt")]) == [str(tmp_path / os.fsdecode(b"caf\xe9.png"))]


def test_already_done_ignores_torn_lines(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"input": "a"}) + "\n" + json.dumps({"input": "b"}) + "\n" + '{"input": "c"')
    assert already_done(out) == {"a", "b"}


# ---- progress -----------------------------------------------------------------------------------
def test_progress_plain_and_tty():
    buf = io.StringIO()
    p = Progress(4, "cap", stream=buf, is_tty=False, interval_s=0.0)
    for i in range(4):
        p.advance(1, failed=int(i == 2))
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("cap: 4/4 (100%)") and "1 failed" in lines[-1]
    assert "items/s" in lines[0] and "ETA" in lines[0]
    assert "ETA 00:00" in lines[-1]  # tqdm's durations
    tty = io.StringIO()
    p = Progress(3, "cap", stream=tty, is_tty=True, interval_s=0.0)
    p.advance()
    p.advance(failed=1)
    p.close()
    text = tty.getvalue()
    redraws = text.split("\r")[1:]  # a bar redrawn in place, one final newline
    assert len(redraws) >= 3 and text.endswith("\n") and text.count("\n") == 1
    assert "|" in redraws[1] and "1/3" in redraws[1] and "item/s" in redraws[1]
    assert "2/3" in redraws[-1] and "1 failed" in redraws[-1]
    nothing = io.StringIO()
    Progress(0, "cap", stream=nothing, is_tty=False).close()
    assert nothing.getvalue() == ""  # nothing to do: the job's summary says so


# ---- a real run (tiny omni checkpoint, CPU) -----------------------------------------------------
from tests.support.caption_inputs import folder_with_broken_files  # noqa: E402
from tests.support.paths import SAMPLE_MEDIA as MEDIA  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    return build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "tiny-omni", seed=0)


def test_caption_folder_with_broken_files_and_resume(model_dir, tmp_path, capsys):
    from mm_pipeline.cli import main

    folder = tmp_path / "media"
    folder.mkdir()
    expect = folder_with_broken_files(folder)
    out = tmp_path / "captions.jsonl"
    argv = ["caption", str(folder), "--model", str(model_dir), "--out", str(out), "--max-tokens", "4",
            "--device", "cpu", "--kv-tokens", "4096"]
    assert main(argv) == 0  # the job ran: failures are reported, not fatal
    recs = {str(Path(r["input"]).relative_to(folder)): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == set(expect)
    for name, modality in expect.items():
        r = recs[name]
        if modality is None:
            assert r["caption"] is None and r["error"], name
        else:
            assert r["error"] is None, (name, r["error"])
            assert r["modality"] == modality and isinstance(r["caption"], str)
            assert r["completion_tokens"] >= 1 and r["timings"]["total_s"] > 0
    assert recs["noise.jpg"]["error"].startswith("UnsupportedMediaType (media): ")
    assert "empty" in recs["empty.mp4"]["error"]
    err = capsys.readouterr().err
    assert "captioned 5 of 9 inputs" in err and "4 failed" in err and "truncated.png" in err

    # resume: nothing left to do; then drop two lines and only those are redone
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 9
    assert "9 already in the output were skipped" in capsys.readouterr().err
    kept = [ln for ln in out.read_text().splitlines()
            if Path(json.loads(ln)["input"]).name not in ("truncated.png", "image_000001.png")]
    out.write_text("\n".join(kept) + "\n" + '{"input": "torn')  # and a torn last line from a crash
    assert main(argv) == 0
    lines = out.read_text().splitlines()
    redone = [json.loads(ln) for ln in lines[len(kept) + 1:]]
    assert sorted(Path(r["input"]).name for r in redone) == ["image_000001.png", "truncated.png"]
    again = next(r for r in redone if r["input"].endswith("image_000001.png"))
    assert again["caption"] == recs["image_000001.png"]["caption"]  # greedy: same caption as the first run


def test_caption_names_a_corrupt_local_image_by_its_path(model_dir, tmp_path, capsys):
    """A local image whose content does not decode: the row's error (and the summary) names the
    file's path and that it does not decode as an image, as the job's other local-file errors name
    theirs (the engine called it an upload: "image from upload cannot be read")."""
    from mm_pipeline.cli import main

    corrupt = tmp_path / "in" / "corrupt.jpg"
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"\xff\xd8\xff\xe0broken")  # a JPEG's magic, then nothing an image decoder reads
    truncated = tmp_path / "in" / "truncated.png"
    truncated.write_bytes((MEDIA / "image_000001.png").read_bytes()[:200])
    out = tmp_path / "captions.jsonl"
    assert main(["caption", str(corrupt.parent), "--model", str(model_dir), "--out", str(out), "--max-tokens", "4",
                 "--device", "cpu", "--kv-tokens", "4096"]) == 0
    rows = {Path(r["input"]).name: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["corrupt.jpg"]["modality"] == "image" and rows["corrupt.jpg"]["caption"] is None
    assert rows["corrupt.jpg"]["error"].startswith(
        f"UndecodableMediaError (media): image from local file {str(corrupt)!r} cannot be read (")
    assert rows["truncated.png"]["error"].startswith(
        f"UndecodableMediaError (media): png image from local file {str(truncated)!r} is damaged (")
    err = capsys.readouterr().err
    assert "upload" not in err and f"local file {str(corrupt)!r}" in err


def test_caption_usage_errors_come_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A bad setting fails every input (and a resumed job would skip them all), a directory or a
    busy file cannot take the rows: each is exit 2 with a message, and the model never loads."""
    from mm_pipeline import cli
    from mm_pipeline.jobs.resume import open_output

    monkeypatch.setattr(cli, "load_engine", lambda *a: pytest.fail("the model must not load"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def rc(*argv: str) -> int:
        try:
            return cli.main(["caption", str(MEDIA / "image_000001.png"), "--model", str(model), *argv])
        except SystemExit as exc:  # argparse's usage errors
            return exc.code

    for flag, value, message in [("--temperature", "-1", "temperature must be a finite number >= 0"),
                                 ("--temperature", "nan", "temperature must be a finite number >= 0"),
                                 ("--max-tokens", "0", "max_tokens must be an integer in [1, "),
                                 ("--concurrency", "0", "concurrency must be >= 1")]:
        assert rc("--out", str(tmp_path / "o.jsonl"), flag, value) == 2
        assert f"argument {flag}: {message}" in capsys.readouterr().err
    assert rc("--out", str(tmp_path)) == 2 and "Is a directory" in capsys.readouterr().err
    with open_output(tmp_path / "busy.jsonl"):
        assert rc("--out", str(tmp_path / "busy.jsonl")) == 2
    assert "being written by another job" in capsys.readouterr().err


def test_caption_missing_default_model_is_a_clear_usage_error(tmp_path, capsys, monkeypatch):
    from mm_pipeline.cli import main

    monkeypatch.setenv("MMSERVE_MODEL", str(tmp_path / "nowhere"))
    assert main(["caption", str(MEDIA)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere") in err and "MMSERVE_MODEL" in err and "--model" in err


def test_caption_from_any_directory_finds_the_demo_model(tmp_path, capsys, monkeypatch):
    """The default model comes from the package's location, not the working directory."""
    from mm_pipeline.cli import REPO_DEMO_MODEL, main

    if not (REPO_DEMO_MODEL / "config.json").is_file():
        pytest.skip("samples/demo-model is not in this checkout")
    monkeypatch.delenv("MMSERVE_MODEL", raising=False)
    monkeypatch.chdir(tmp_path)  # no samples/ here
    assert main(["caption", str(MEDIA / "image_000001.png"), "--max-tokens", "4", "--device", "cpu"]) == 0
    (rec,) = map(json.loads, (tmp_path / "captions.jsonl").read_text().splitlines())
    assert rec["error"] is None and rec["modality"] == "image" and rec["caption"]
