"""The C-kernel loader: builds once, caches per source/compiler/CPU, falls back to None, never raises."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from kernels.native import build

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

ADD = "void add(const float *a, const float *b, float *out, long n) { for (long i = 0; i < n; i++) out[i] = a[i] + b[i]; }\n"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_enabled", True)
    src = tmp_path / "src"
    src.mkdir()
    return src


def _call_add(lib) -> list[float]:
    a, b, out = (ctypes.c_float * 3)(1, 2, 3), (ctypes.c_float * 3)(10, 20, 30), (ctypes.c_float * 3)()
    lib.add(a, b, out, ctypes.c_long(3))
    return list(out)


@needs_cc
def test_a_source_is_built_once_and_the_cached_library_is_reused_by_a_new_process(fresh, monkeypatch):
    (fresh / "adder.c").write_text(ADD)
    lib = build.library("adder", source_dir=fresh)
    assert lib is not None and _call_add(lib) == [11.0, 22.0, 33.0]
    assert build.library("adder", source_dir=fresh) is lib  # once per process
    built = list((build._cache_dir()).glob("adder-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(build, "_loaded", {})  # as a new process: the cached file loads, no compile

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(build, "_compile", no_compile)
    assert _call_add(build.library("adder", source_dir=fresh)) == [11.0, 22.0, 33.0]


@needs_cc
def test_a_changed_source_or_flag_builds_a_new_library(fresh):
    (fresh / "adder.c").write_text(ADD)
    build.library("adder", source_dir=fresh)
    build.library("adder", source_dir=fresh, flags=("-DUNUSED=1",))
    (fresh / "adder.c").write_text(ADD + "/* changed */\n")
    build._loaded.clear()
    build.library("adder", source_dir=fresh)
    assert len(list(build._cache_dir().glob("adder-*.so"))) == 3


@needs_cc
def test_a_changed_header_next_to_the_source_builds_a_new_library(fresh):
    """Shared code lives in headers (small_gemm.h): a change there must not load a stale build."""
    (fresh / "part.h").write_text("#define SCALE 1.0f\n")
    (fresh / "adder.c").write_text('#include "part.h"\n' + ADD.replace("a[i] + b[i]", "SCALE * a[i] + b[i]"))
    assert _call_add(build.library("adder", source_dir=fresh)) == [11.0, 22.0, 33.0]
    (fresh / "part.h").write_text("#define SCALE 2.0f\n")
    build._loaded.clear()
    assert _call_add(build.library("adder", source_dir=fresh)) == [12.0, 24.0, 36.0]


@needs_cc
def test_a_broken_source_gives_none_and_a_warning_not_an_exception(fresh, caplog):
    (fresh / "broken.c").write_text("this is not C\n")
    assert build.library("broken", source_dir=fresh) is None
    assert "broken" in caplog.text and "not built" in caplog.text
    assert not list(build._cache_dir().glob("*.so")) and not list(build._cache_dir().glob("*.tmp"))


def test_no_compiler_or_switched_off_gives_none(fresh, monkeypatch):
    (fresh / "adder.c").write_text(ADD)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert build.library("adder", source_dir=fresh) is None
    build._loaded.clear()
    build.set_enabled(False)
    assert not build.enabled() and build.library("adder", source_dir=fresh) is None
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.set_enabled(True)  # the environment's "0" wins over the config
    assert not build.enabled()



@needs_cc
def test_an_engine_builds_its_kernels_when_it_starts_not_in_its_first_step(tmp_path, monkeypatch):
    import torch

    from llm_core import EngineConfig, LLMEngine
    from llm_core.model.loader import load_model
    from samples.checkpoints.tiny_text import build_tiny_hf_checkpoint

    model = load_model(build_tiny_hf_checkpoint(tmp_path / "hf"), dtype=torch.float32)
    monkeypatch.setattr(build, "_loaded", {})  # as a fresh process (the disk cache may still hold them)
    monkeypatch.setattr(build, "_enabled", True)
    LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=256, num_swa_tokens=256))
    assert {name for name, *_ in build._loaded} == {"fused_layer", "decoder_layer", "greedy_head", "moe_experts",
                                                       "mtp_draft", "paged_decode"}
    assert all(lib is not None for lib in build._loaded.values())
    monkeypatch.setattr(build, "_loaded", {})
    LLMEngine(model, EngineConfig(page_size=4, num_full_tokens=256, num_swa_tokens=256, native_cpu_kernels=False))
    assert build._loaded == {}
