"""The paged-KV attention op: contract (metadata), reference, CPU and GPU implementations.

Importing this package registers `torch.ops.trtforge.paged_attention`.
"""

from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.plugins.paged_attention.op import (
                                                 IMPLS,
                                                 AttentionImpl,
                                                 attention_impl,
                                                 paged_attention,
                                                 paged_attention_int8kv_op,
                                                 paged_attention_op,
                                                 resolve_impl,
)
from trtforge.plugins.paged_attention.reference import dequantize_kv, quantize_kv, write_kv

__all__ = [
    "AttentionImpl",
    "AttentionMetadata",
    "IMPLS",
    "attention_impl",
    "paged_attention",
    "paged_attention_int8kv_op",
    "paged_attention_op",
    "dequantize_kv",
    "quantize_kv",
    "resolve_impl",
    "write_kv",
]
