"""Remembered checksums: an unchanged big file is hashed once; any change means hashing again."""

from __future__ import annotations

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
