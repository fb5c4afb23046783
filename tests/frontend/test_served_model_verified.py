"""The OpenAI front end reads its engine as the engine model does (frontend/served_model.py):
engine.json's names, unlisted files and the tokenizer's sha256s are checked before the tokenizer
is loaded; only the weights' digests, which the front end never opens, are left to the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.checkpoints import build_tiny_engine
from trtforge.frontend.served_model import load_served_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("eng"), "qwen2")


def _repo(tmp_path: Path, engine_dir: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "ensemble").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(
        'name: "ensemble"\nparameters {\n  key: "engine_dir"\n  value { string_value: "%s" }\n}\n' % engine_dir)
    return repo


def test_a_built_engine_is_served(engine, tmp_path):
    served = load_served_model(_repo(tmp_path, engine))
    assert served.max_seq_len == 64 and served.count_tokens("hello world") > 0


def test_a_swapped_tokenizer_is_refused(engine, tmp_path):
    copy = Path(shutil.copytree(engine, tmp_path / "copy"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'anything the attacker wants the model to be told' }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"engine_dir: .*tokenizer_config.json does not match the sha256 "
                                         r"recorded in engine.json.*--force"):
        load_served_model(_repo(tmp_path, copy))


def test_an_unlisted_tokenizer_file_is_refused(engine, tmp_path):
    copy = Path(shutil.copytree(engine, tmp_path / "copy"))
    planted = next(n for n in ("chat_template.jinja", "chat_template.json") if not (copy / n).exists())
    (copy / planted).write_text("{{ 'planted' }}")  # transformers reads a chat template from it
    with pytest.raises(ValueError, match=f"holds {planted}, which engine.json does not list"):
        load_served_model(_repo(tmp_path, copy))


def test_weights_are_the_engine_models_to_check(engine, tmp_path):
    copy = Path(shutil.copytree(engine, tmp_path / "copy"))
    with open(copy / "rank0.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    assert load_served_model(_repo(tmp_path, copy)).max_seq_len == 64
