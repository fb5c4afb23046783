"""Remembered checksums: an unchanged big file is hashed once; any change means hashing again."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from trtforge.models import verified_files as vf


@pytest.fixture
def counting(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(vf, "MIN_BYTES", 16)
    calls = []

    def hash_file(path):
        calls.append(path)
        return f"digest-of-{path.read_bytes()[:8].hex()}"

    return hash_file, calls


def _settled_file(path, data=b"0123456789abcdef" * 4):
    path.write_bytes(data)
    old = time.time() - 60
    os.utime(path, (old, old))  # mtime only: ctime stays now, so wait it out via SETTLE_S
    return path


def test_unchanged_file_is_hashed_once(counting, tmp_path, monkeypatch):
    hash_file, calls = counting
    path = _settled_file(tmp_path / "w.bin")
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)  # the file's ctime is "old enough" at once
    time.sleep(0.01)
    first = vf.digest_of(path, hash_file)
    assert vf.digest_of(path, hash_file) == first and len(calls) == 1


def test_a_write_means_hashing_again(counting, tmp_path, monkeypatch):
    hash_file, calls = counting
    path = _settled_file(tmp_path / "w.bin")
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)
    time.sleep(0.01)
    vf.digest_of(path, hash_file)
    with open(path, "r+b") as f:  # same size, mtime put back: only ctime (and content) differ
        f.write(b"XXXX")
    os.utime(path, (time.time() - 60, time.time() - 60))
    assert vf.digest_of(path, hash_file) == f"digest-of-{path.read_bytes()[:8].hex()}" and len(calls) == 2


def test_a_just_written_file_is_not_remembered(counting, tmp_path):
    """Racily clean: a ctime younger than SETTLE_S could hide a later write in the same tick."""
    hash_file, calls = counting
    path = tmp_path / "w.bin"
    path.write_bytes(b"0123456789abcdef" * 4)
    vf.digest_of(path, hash_file)
    vf.digest_of(path, hash_file)
    assert len(calls) == 2 and not any(vf.cache_dir().glob("*.json"))


def test_small_files_and_unwritable_cache_just_hash(counting, tmp_path, monkeypatch):
    hash_file, calls = counting
    small = tmp_path / "s.txt"
    small.write_bytes(b"tiny")
    vf.digest_of(small, hash_file)
    vf.digest_of(small, hash_file)
    monkeypatch.setenv("TRTFORGE_CACHE_DIR", str(small))  # a file: records cannot be written
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)
    path = _settled_file(tmp_path / "w.bin")
    time.sleep(0.01)
    vf.digest_of(path, hash_file)
    vf.digest_of(path, hash_file)
    assert len(calls) == 4


def _forged_record(path, digest):
    """What another user sharing the cache could write: a record vouching for `path` as it is now."""
    stamp = vf._stamp(path)
    target = vf._record_path(vf.cache_dir(), path, stamp)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"file": str(path.resolve()), "stamp": stamp, "sha256": digest}))
    return target


def test_records_in_a_directory_others_can_write_are_not_trusted(counting, tmp_path, monkeypatch, caplog):
    hash_file, calls = counting
    path = _settled_file(tmp_path / "w.bin")
    _forged_record(path, "the-digest-engine-json-expects")
    vf.cache_dir().chmod(0o777)
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)
    monkeypatch.setattr(vf, "_warned", set())
    time.sleep(0.01)
    with caplog.at_level(logging.WARNING):
        assert vf.digest_of(path, hash_file) == f"digest-of-{path.read_bytes()[:8].hex()}"
        vf.digest_of(path, hash_file)
    assert len(calls) == 2, "hashed every time, the planted record ignored"
    assert caplog.text.count("writable by its group or by everyone") == 1, "said once"
    assert len(list(vf.cache_dir().glob("*.json"))) == 1, "nothing remembered there either"


def test_records_owned_by_someone_else_are_not_trusted(counting, tmp_path, monkeypatch):
    hash_file, calls = counting
    path = _settled_file(tmp_path / "w.bin")
    _forged_record(path, "the-digest-engine-json-expects")
    vf.cache_dir().chmod(0o700)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 4242)
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)
    time.sleep(0.01)
    assert vf.digest_of(path, hash_file).startswith("digest-of-") and len(calls) == 1


def test_records_directory_is_created_private(counting, tmp_path, monkeypatch):
    hash_file, _ = counting
    path = _settled_file(tmp_path / "w.bin")
    monkeypatch.setattr(vf, "SETTLE_S", 0.0)
    time.sleep(0.01)
    vf.digest_of(path, hash_file)
    assert vf.cache_dir().stat().st_mode & 0o777 == 0o700
    assert list(vf.cache_dir().glob("*.json")), "remembered in a private directory"
