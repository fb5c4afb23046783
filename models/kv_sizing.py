"""How much KV memory a token takes, and how many KV blocks a budget buys (the build reports it,
the runtime allocates it)."""

from __future__ import annotations

from trtforge.models.dtypes import DTYPE_BYTES
from trtforge.models.model_config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, kv_cache_dtype: str | None = None) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × dtype bytes. Llama-2-7B fp16: 512 KiB.
    kv_cache_dtype "int8" (--kv-cache-dtype): head_dim int8 bytes + one float32 scale per token,
    layer, kv head and K/V; None / "auto": the model dtype."""
    per_head = cfg.head_dim + 4 if kv_cache_dtype == "int8" else cfg.head_dim * DTYPE_BYTES[dtype]
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def kv_num_blocks(cfg: ModelConfig, dtype: str, block_size: int, kv_cache_bytes: int,
                  kv_cache_dtype: str | None = None) -> int:
    """Whole KV blocks of `block_size` tokens that `kv_cache_bytes` of memory holds: what the
    build reports and what the runtime allocates (int8 KV: values and scales counted)."""
    return kv_cache_bytes // (kv_bytes_per_token(cfg, dtype, kv_cache_dtype) * block_size)
