"""A `--backend trtllm` engine directory as far as the emitter reads it, and the recorded upstream
interfaces (test data: upstream_<tag>.json per release, extracted by scripts/trtllm_facts.py from
the templates at the commits they name: tensorrtllm_backend v0.19.0, TensorRT-LLM 1.2.0rc8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model_repo.engines import engine_json
from trtforge.builder.trtllm.versions import RELEASES
from trtforge.model_repo.trtllm import llmapi
from trtforge.model_repo.trtllm.files import MODEL_FILES

HERE = Path(__file__).parent
RECORD = HERE / "upstream_v0.19.0.json"
RELEASE_VERSIONS = tuple(RELEASES)


def record_of(version: str) -> dict:
    """The test data's copy of a release's record."""
    return json.loads((HERE / f"upstream_{RELEASES[version].backend_release}.json").read_text())


def write_engine(d: Path, tensorrt_llm: str = "0.19.0") -> Path:
    """engine.json as build-engine --backend trtllm writes it under TensorRT-LLM `tensorrt_llm`
    (the engine files themselves need TensorRT-LLM; the emitter only reads engine.json)."""
    d.mkdir(parents=True)
    (d / "engine.json").write_text(engine_json(
        backend="trtllm", dtype="float16",
        build={"backend": "trtllm", "dtype": "float16", "max_batch_size": 8,
               "max_num_tokens": 256, "max_seq_len": 128, "kv_block_size": 16,
               "kv_cache_memory": "4MiB", "allow_pickle": False},
        scheduling={"max_num_tokens": 256, "max_batch_size": 8, "prefill_chunk_size": 256,
                    "prefill_max_seqs": 8},
        report={"kv_bytes_per_token": 4096},
        versions={"tensorrt_llm": tensorrt_llm, "tensorrt": "10.10.0.31"}))
    return d


def fake_models_dir(root: Path) -> Path:
    """A stand-in for the image's all_models/inflight_batcher_llm: placeholder files where
    TensorRT-LLM's are (their content is not ours to copy into the project or its tests)."""
    base = root / "all_models" / "inflight_batcher_llm"
    tables = {**MODEL_FILES, "llmapi": llmapi.FILES}
    for model, files in tables.items():
        for rel in files.values():
            path = (base / rel).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# stand-in for TensorRT-LLM's {model} {path.name}\n")
    return base


@pytest.fixture(scope="session")
def upstream() -> dict:
    return json.loads(RECORD.read_text())


@pytest.fixture(autouse=True)
def _no_drift_override(monkeypatch):
    """Drift is an error unless the test itself overrides it."""
    monkeypatch.delenv("TRTFORGE_TRTLLM_ALLOW_DRIFT", raising=False)


@pytest.fixture()
def trtllm_engine(tmp_path) -> Path:
    return write_engine(tmp_path / "engine")


@pytest.fixture(params=RELEASE_VERSIONS)
def release_engine(request, tmp_path) -> tuple[str, Path]:
    """(TensorRT-LLM version, an engine built with it), for every recorded release."""
    return request.param, write_engine(tmp_path / f"engine-{request.param}", request.param)
