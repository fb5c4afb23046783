"""A `--backend trtllm` engine directory as far as the emitter reads it, and the recorded upstream
interface (test data: upstream_v0.19.0.json, extracted by scripts/trtllm_facts.py from
triton-inference-server/tensorrtllm_backend at the commit it names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model_repo.engines import engine_json

RECORD = Path(__file__).with_name("upstream_v0.19.0.json")


@pytest.fixture(scope="session")
def upstream() -> dict:
    return json.loads(RECORD.read_text())


@pytest.fixture()
def trtllm_engine(tmp_path) -> Path:
    """engine.json as build-engine --backend trtllm writes it (the engine files themselves need
    TensorRT-LLM; the emitter only reads engine.json)."""
    d = tmp_path / "engine"
    d.mkdir()
    (d / "engine.json").write_text(engine_json(
        backend="trtllm", dtype="float16",
        build={"backend": "trtllm", "dtype": "float16", "max_batch_size": 8,
               "max_num_tokens": 256, "max_seq_len": 128, "kv_block_size": 16,
               "kv_cache_memory": "4MiB", "allow_pickle": False},
        scheduling={"max_num_tokens": 256, "max_batch_size": 8, "prefill_chunk_size": 256,
                    "prefill_max_seqs": 8},
        report={"kv_bytes_per_token": 4096},
        versions={"tensorrt_llm": "0.19.0", "tensorrt": "10.10.0.31"}))
    return d
