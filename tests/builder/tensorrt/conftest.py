"""Tiny random engines (one per architecture family) shared by the ONNX tests."""

from __future__ import annotations

import pytest

ARCHS = ("llama", "qwen2", "qwen3", "gpt2")


@pytest.fixture(scope="session")
def engine_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> torch-backend float32 engine directory built from a random HF checkpoint."""
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    root = tmp_path_factory.mktemp("onnx_engines")
    out = {}
    for arch in ARCHS:
        ckpt = write_demo_checkpoint(root / f"{arch}-ckpt", arch=arch, size="tiny", seed=1)
        build = BuildConfig(dtype="float32", max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                            kv_block_size=4, kv_cache_memory="1MiB")
        out[arch], _ = build_engine(str(ckpt), root / f"{arch}-engine", build, progress=False)
    return out
