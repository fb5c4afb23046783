"""Fixtures of the repository tests."""

from __future__ import annotations

import pytest

from tests.model_repo.engines import engine_json


@pytest.fixture()
def engine_dir(tmp_path):
    """The part of an engine directory the emitter reads: engine.json's build limits and
    scheduling defaults, as build-engine records them (the e2e tests use a real build)."""
    d = tmp_path / "engine"
    d.mkdir()
    (d / "engine.json").write_text(engine_json(
        build={"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 128,
               "kv_block_size": 16, "kv_cache_memory": "4MiB"},
        scheduling={"max_num_tokens": 256, "max_batch_size": 8, "prefill_chunk_size": 256,
                    "prefill_max_seqs": 8}))
    return d
