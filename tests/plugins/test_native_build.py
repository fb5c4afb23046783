"""Building and loading the native CPU kernels (plugins/native.py): cached by content, and every
way of not having them (no compiler, a failing build, switched off) falls back with a reason."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os

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
    lib = native.load(src, {"trtforge_answer": (ctypes.c_int, [])})
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


# ---- the cache is code this process runs: only this user may write it ------------------------

def _answer_lib(tmp_path):
    src = _source(tmp_path)
    return src, native.build(src)


def test_cache_directory_created_private_and_library_recorded(tmp_path):
    src, so = _answer_lib(tmp_path)
    assert so.parent == native.cache_dir()
    for directory in (native.cache_dir(), native.cache_root()):
        assert directory.stat().st_mode & 0o777 == 0o700, oct(directory.stat().st_mode)
    records = list(so.parent.glob("answer-*.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert so.name == f"{records[0].stem}-{record['sha256'][:16]}.so"  # stored under its own digest
    assert record["flags"] == [*native.CFLAGS, *native.isa_flags(native.isa())] and len(record["inputs"]) == 64


def test_planted_library_with_the_same_name_is_not_loaded(tmp_path, caplog):
    src, so = _answer_lib(tmp_path)
    # Another library, same exported function, put where the cached one was (same name).
    evil = native.build(_source(tmp_path, SOURCE.replace("42", "666"), name="evil.c"))
    so.write_bytes(evil.read_bytes())
    with caplog.at_level(logging.WARNING):
        lib = native.load(src, {"trtforge_answer": (ctypes.c_int, [])})
    assert lib.trtforge_answer() == 42, "the planted library was loaded"
    assert "does not match the sha256 recorded" in caplog.text
    assert hashlib.sha256(so.read_bytes()).hexdigest() != hashlib.sha256(evil.read_bytes()).hexdigest()


def test_library_without_a_record_is_not_loaded(tmp_path):
    """A .so that no build of this process's kind recorded (a cache written before records, or
    one copied in) is rebuilt, never trusted."""
    src, so = _answer_lib(tmp_path)
    for record in so.parent.glob("*.json"):
        record.unlink()
    evil = native.build(_source(tmp_path, SOURCE.replace("42", "666"), name="evil.c"))
    so.write_bytes(evil.read_bytes())
    lib = native.load(src, {"trtforge_answer": (ctypes.c_int, [])})
    assert lib.trtforge_answer() == 42


def test_a_forged_record_naming_another_path_is_not_followed(tmp_path):
    src, so = _answer_lib(tmp_path)
    (record,) = so.parent.glob("answer-*.json")
    forged = json.loads(record.read_text())
    forged["sha256"] = "../../" + forged["sha256"][6:]  # not a digest: the library name is derived from it
    record.write_text(json.dumps(forged))
    assert native.build(src) == so  # rebuilt under its digest's name, the record rewritten
    assert json.loads(record.read_text())["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_group_or_world_writable_cache_is_refused(tmp_path, caplog, mode):
    native.cache_dir().mkdir(parents=True)
    native.cache_dir().chmod(mode)
    with caplog.at_level(logging.WARNING):
        assert native.load(_source(tmp_path), SIGNATURES) is None
    assert "torch path" in caplog.text and "writable by its group or by everyone" in caplog.text
    assert "TRTFORGE_CACHE_DIR" in caplog.text
    assert not list(native.cache_dir().iterdir()), "nothing built into a directory others can write"


def test_cache_owned_by_someone_else_is_refused(tmp_path, monkeypatch, caplog):
    native.cache_dir().mkdir(parents=True, mode=0o700)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 4242)  # the directory is now another user's
    with caplog.at_level(logging.WARNING):
        assert native.load(_source(tmp_path), SIGNATURES) is None
    assert f"owned by uid {me}, not by this user (uid {me + 4242})" in caplog.text


def test_cache_below_a_shared_directory_is_refused(tmp_path, monkeypatch):
    """TRTFORGE_CACHE_DIR shared by a team (group-writable, no sticky bit): our own private
    `native` in it could be renamed away and replaced by another member's."""
    shared = tmp_path / "team-cache"
    shared.mkdir()
    shared.chmod(0o775)
    monkeypatch.setenv("TRTFORGE_CACHE_DIR", str(shared))
    with pytest.raises(native.UnsafeCacheDir, match="writable by others without the sticky bit"):
        native.build(_source(tmp_path))
    shared.chmod(0o1777)  # /tmp-like: only an entry's owner may rename it
    assert native.build(_source(tmp_path)).is_file()
