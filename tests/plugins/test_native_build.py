"""Building and loading the native CPU kernels (plugins/native.py): cached by content, and every
way of not having them (no compiler, a failing build, switched off) falls back with a reason."""

from __future__ import annotations

import logging

import pytest

from trtforge.plugins import native

SOURCE = "int trtforge_answer(void) { return 42; }\n"
SIGNATURES = {"trtforge_answer": (None, [])}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setattr(native, "_loaded", {})


def _source(tmp_path, text=SOURCE, name="answer.c"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_build_once_and_rebuild_when_the_source_changes(tmp_path):
    src = _source(tmp_path)
    first = native.build(src)
    mtime = first.stat().st_mtime_ns
    assert native.build(src) == first and first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    src.write_text(SOURCE.replace("42", "43"))
    assert native.build(src) != first
    lib = native.load(src, {"trtforge_answer": (__import__("ctypes").c_int, [])})
    assert lib.trtforge_answer() == 43
    assert not list(first.parent.glob("tmp*")), "no half-built temporary left behind"


def test_a_failing_build_falls_back_and_says_why(tmp_path, caplog):
    src = _source(tmp_path, "int broken( {\n", name="broken.c")
    with pytest.raises(RuntimeError, match="broken.c"):
        native.build(src)
    with caplog.at_level(logging.WARNING):
        assert native.load(src, SIGNATURES) is None
    assert "torch path" in caplog.text and "broken.c" in caplog.text


def test_no_compiler_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "trtforge-no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert native.load(_source(tmp_path), SIGNATURES) is None
    assert "no C compiler" in caplog.text


def test_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert native.load(_source(tmp_path), SIGNATURES) is None
    assert not (tmp_path / "cache").exists(), "switched off means nothing is built"
