"""Attacks on an engine directory (models/engine_dir.py): engine.json naming files outside the
directory, files the build did not record, a swapped tokenizer, links out. Each is refused before
anything is loaded, with a message that says what differs and how to rebuild."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.checkpoints import build_tiny_engine
from trtforge.models.engine_dir import ENGINE_JSON, plain_name, read_engine_config, sha256
from trtforge.models.errors import EngineLoadError

REBUILD = "build-engine CHECKPOINT --output"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("eng"), "llama")


@pytest.fixture
def copy(engine, tmp_path) -> Path:
    return Path(shutil.copytree(engine, tmp_path / "copy"))


def _edit_files(directory: Path, edit) -> None:
    raw = json.loads((directory / ENGINE_JSON).read_text())
    edit(raw["files"])
    (directory / ENGINE_JSON).write_text(json.dumps(raw))


def test_a_built_engine_verifies(engine):
    cfg = read_engine_config(engine)
    assert set(cfg.files) == {p.name for p in engine.iterdir()} - {ENGINE_JSON}
    assert all(plain_name(n) for n in cfg.files)


@pytest.mark.parametrize("name", ["../outside.json", "/etc/hostname", "sub/tokenizer.json", "..", ".",
                                  "", "a\\b", ENGINE_JSON])
def test_names_that_leave_the_directory_are_refused(copy, tmp_path, name):
    (tmp_path / "outside.json").write_text("{}")
    digest = sha256(tmp_path / "outside.json")
    _edit_files(copy, lambda files: files.__setitem__(name, digest))
    for verify in (True, False):  # the names are checked even when the digests are not
        with pytest.raises(EngineLoadError, match="only plain file names") as info:
            read_engine_config(copy, verify_checksums=verify)
        assert repr(name) in str(info.value) and REBUILD in str(info.value) and "--force" in str(info.value)


def test_an_unlisted_weights_file_is_refused(copy):
    """rank0.safetensors swapped for other weights and dropped from engine.json's list (so that
    no digest is compared): refused as unlisted, not loaded unchecked."""
    _edit_files(copy, lambda files: files.pop("rank0.safetensors"))
    with pytest.raises(EngineLoadError, match=r"holds rank0.safetensors, which engine.json does not list") as info:
        read_engine_config(copy)
    assert "Move it out of the directory" in str(info.value) and "--force" in str(info.value)


@pytest.mark.parametrize("extra", ["config.json", "rank1.safetensors", "chat_template.json", ".hidden"])
def test_any_unlisted_file_is_refused(copy, extra):
    (copy / extra).write_text("{}")
    with pytest.raises(EngineLoadError, match=f"holds {extra}, which engine.json does not list"):
        read_engine_config(copy)
    with pytest.raises(EngineLoadError, match="does not list"):  # the front end's check too
        read_engine_config(copy, verify_weights=False)


def test_an_unlisted_subdirectory_is_refused(copy):
    (copy / "additional_chat_templates").mkdir()
    (copy / "additional_chat_templates" / "tool.jinja").write_text("{{ evil }}")
    with pytest.raises(EngineLoadError, match="holds additional_chat_templates, which"):
        read_engine_config(copy)


def test_a_swapped_tokenizer_file_is_refused(copy):
    tok = json.loads((copy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: same size, other text
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    for verify_weights in (True, False):
        with pytest.raises(EngineLoadError, match=r"tokenizer.json does not match the sha256 recorded in "
                                                  r"engine.json \(recorded [0-9a-f]{12}…, found [0-9a-f]{12}…\)"):
            read_engine_config(copy, verify_weights=verify_weights)


def test_a_listed_file_that_links_out_of_the_directory_is_refused(copy, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.copy2(copy / "tokenizer_config.json", outside)  # the same bytes: the digest would match
    (copy / "tokenizer_config.json").unlink()
    os.symlink(outside, copy / "tokenizer_config.json")
    with pytest.raises(EngineLoadError, match="is a symbolic link to .*elsewhere.json, outside the engine"):
        read_engine_config(copy)


def test_a_link_inside_the_directory_is_allowed(copy):
    shutil.move(copy / "tokenizer_config.json", copy / "tokenizer_config.real")
    os.symlink("tokenizer_config.real", copy / "tokenizer_config.json")
    _edit_files(copy, lambda files: files.__setitem__("tokenizer_config.real", files["tokenizer_config.json"]))
    read_engine_config(copy)


def test_a_listed_directory_is_not_a_file(copy):
    (copy / "tokenizer_config.json").unlink()
    (copy / "tokenizer_config.json").mkdir()
    with pytest.raises(EngineLoadError, match="tokenizer_config.json is listed in engine.json but missing"):
        read_engine_config(copy)


def test_front_end_skips_only_the_weights_digests(copy):
    """verify_weights=False (the OpenAI front end, which never opens the weights) still checks
    names, unlisted files and every other digest."""
    with open(copy / "rank0.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    read_engine_config(copy, verify_weights=False)
    with pytest.raises(EngineLoadError, match="rank0.safetensors does not match"):
        read_engine_config(copy)


def test_files_must_map_names_to_digests(copy):
    raw = json.loads((copy / ENGINE_JSON).read_text())
    raw["files"] = ["rank0.safetensors"]
    (copy / ENGINE_JSON).write_text(json.dumps(raw))
    with pytest.raises(EngineLoadError, match="`files` must map file names to sha256 digests"):
        read_engine_config(copy, verify_checksums=False)
