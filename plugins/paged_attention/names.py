"""The names of the paged-attention node, shared by its ONNX export, ONNX Runtime and TensorRT.

The three must agree on every spelling: the exporter writes these names into the graph, ONNX
Runtime's PyOp and TensorRT's plugin registry look the node up by them. They are also baked into
every exported `rank0.onnx` and every serialized TensorRT plan, so changing one orphans the
engines already built (docs/tensorrt.md documents them as the contract).
"""

from __future__ import annotations

DOMAIN = "trtforge"
"""ONNX domain of the node (an opset import of this name, version `DOMAIN_VERSION`)."""

DOMAIN_VERSION = 1
"""Version of the `DOMAIN` opset that the node belongs to."""

OP_TYPE = "PagedAttention"
"""ONNX op_type of the node, which is also the TensorRT plugin's name."""

PLUGIN_NAMESPACE = DOMAIN
"""TensorRT plugin namespace (the node's `plugin_namespace` attribute). The same as the ONNX domain,
so that one qualified name serves ONNX Runtime and TensorRT."""

PLUGIN_VERSION = "1"
"""TensorRT plugin version (the node's `plugin_version` attribute)."""

QUALIFIED_NAME = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
"""`trtforge::PagedAttention`: TensorRT's plugin id, the op_type onnxruntime-extensions registers
the PyOp under (domain::op_type), and how graph checks count the node."""

INPUT_NAMES = ("q", "k", "v", "kv_cache", "slot_mapping", "block_tables", "seq_lens",
               "query_start_loc")
"""The node's inputs, in order."""

OUTPUT_NAMES = ("out", "kv_cache_out")
"""The node's outputs, in order: attention output [T, Hq, D] and the KV pool after the write."""
