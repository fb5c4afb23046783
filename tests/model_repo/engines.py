"""engine.json as build-engine writes it, for the emitter tests: the emitter reads engine.json only
(models/engine_dir.read_engine_config, checksums not checked), so no weights are needed."""

from __future__ import annotations

from typing import Any

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.model_config import ModelConfig

TINY_MODEL = ModelConfig(
    architecture="LlamaForCausalLM", family="llama", vocab_size=256, hidden_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, norm="rms", norm_eps=1e-5,
    activation="silu", gated_mlp=True, position="rope", max_position_embeddings=128,
    tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


def engine_json(build: dict[str, Any], scheduling: dict[str, Any], **fields: Any) -> str:
    """engine.json text with these build limits and scheduling defaults (and EngineConfig
    `fields`: backend, report, versions, …)."""
    return EngineConfig(model=TINY_MODEL, build=build, dtype=fields.pop("dtype", "float32"),
                        scheduling=scheduling, **fields).to_json()
