"""A `--backend trtllm` repository as emit-repo writes it, on CPU: a tiny engine directory whose
engine.json says it was built by TensorRT-LLM (the engine files need TensorRT-LLM; the emitter
and the OpenAI front end read engine.json and the tokenizer only), and the repository written
for one recorded release."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.trtllm.values import TrtllmOptions


def trtllm_engine(torch_engine: Path, directory: Path, version: str) -> Path:
    """A copy of a built torch engine directory (tokenizer and hashes kept) whose engine.json says
    build-engine --backend trtllm wrote it with TensorRT-LLM `version`."""
    engine = Path(shutil.copytree(torch_engine, directory))
    raw = json.loads((engine / "engine.json").read_text())
    raw["backend"] = raw["build"]["backend"] = "trtllm"
    raw["versions"]["tensorrt_llm"] = version
    raw.setdefault("report", {})["kv_bytes_per_token"] = 4096
    (engine / "engine.json").write_text(json.dumps(raw))
    return engine


def trtllm_repo(torch_engine: Path, directory: Path, version: str) -> Path:
    """The repository emit-repo writes for a trtllm engine of TensorRT-LLM `version`."""
    engine = trtllm_engine(torch_engine, directory / "engine", version)
    return emit_repo(engine, directory / "repo", trtllm_models_dir=TrtllmOptions(version=version))
