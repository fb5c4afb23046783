"""The paged-KV attention op: contract (metadata), reference, CPU and GPU implementations.

Importing this package registers `torch.ops.trtforge.paged_attention`.
"""

from .metadata import AttentionMetadata
from .op import (IMPLS, get_attention_impl, paged_attention, paged_attention_int8kv_op, paged_attention_op,
                 resolve_impl, set_attention_impl)
from .reference import dequantize_kv, quantize_kv, write_kv

__all__ = [
    "AttentionMetadata",
    "IMPLS",
    "get_attention_impl",
    "paged_attention",
    "paged_attention_int8kv_op",
    "paged_attention_op",
    "dequantize_kv",
    "quantize_kv",
    "resolve_impl",
    "set_attention_impl",
    "write_kv",
]
