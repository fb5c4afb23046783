"""Export side of the paged-KV attention op: a functional twin and its ONNX translation.

The network calls `torch.ops.trtforge.paged_attention`, which updates the layer's KV pool in
place. ONNX has no in-place updates and torch's ONNX exporter cannot translate the
`auto_functionalized` wrapper that such an op becomes, so for export only:

    torch.ops.trtforge.paged_attention(q, k, v, kv, ...) -> out           (mutates kv)
          │  redirect_paged_attention(sink) swaps it, for the duration of the trace, for
          ▼
    torch.ops.trtforge.paged_attention_export(q, k, v, kv, ...) -> (out, kv_out)
          │  custom_translation_table
          ▼
    trtforge::PagedAttention(q, k, v, kv, slot_mapping, block_tables, seq_lens,
                             query_start_loc) -> (out, kv_out)
        attributes: scale, plugin_namespace="trtforge", plugin_version="1"

`kv_out` is collected in `sink` so the export wrapper can make it a graph output ("present
KV"). TensorRT's plugin aliases it to the KV input (the pool is updated in place on the GPU);
ONNX Runtime's PyOp returns a fresh copy that the caller feeds back on the next step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import onnxscript
import torch
from onnx.defs import OpSchema

import trtforge.plugins.paged_attention  # noqa: F401  (registers torch.ops.trtforge.paged_attention)
from trtforge.plugins.paged_attention import reference
from trtforge.plugins.paged_attention.names import (
    DOMAIN,
    DOMAIN_VERSION,
    INPUT_NAMES,
    OP_TYPE,
    OUTPUT_NAMES,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
)

FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


@torch.library.custom_op("trtforge::paged_attention_export", mutates_args=())
def paged_attention_export(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional paged attention: (out [T, Hq, D], updated copy of kv_cache). Export only."""
    kv_out = kv_cache.clone()
    out = reference.paged_attention(q, k, v, kv_out, slot_mapping, block_tables, seq_lens,
                                    query_start_loc, scale)
    return out, kv_out


@paged_attention_export.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return q.new_empty(q.shape), kv_cache.new_empty(kv_cache.shape)


def _schema() -> OpSchema:
    """ONNX schema of the node: lets onnxscript build it with two typed outputs."""
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    input_types = ("T", "T", "T", "T", "I64", "I32", "I32", "I32")  # in INPUT_NAMES order
    return OpSchema(
        OP_TYPE, DOMAIN, DOMAIN_VERSION,
        doc="Paged-KV attention over packed tokens; writes k/v into the pool (the trtforge op contract).",
        inputs=[param(name, typ) for name, typ in zip(INPUT_NAMES, input_types, strict=True)],
        outputs=[param(name, "T") for name in OUTPUT_NAMES],
        type_constraints=[("T", FLOAT_TYPES, "activations and KV pool"),
                          ("I64", ["tensor(int64)"], "slots"),
                          ("I32", ["tensor(int32)"], "tables, lengths and offsets")],
        attributes=[attr("scale", OpSchema.AttrType.FLOAT, "softmax scale"),
                    attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                    attr("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version")],
    )


_OPSET = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)
_PAGED_ATTENTION = onnxscript.values.Op(_OPSET, OP_TYPE, op_schema=_schema())


def _translate(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
               scale: float):
    """custom_translation_table entry: one `trtforge::PagedAttention` node."""
    out, kv_out = _PAGED_ATTENTION(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
                                   query_start_loc, scale=scale, plugin_namespace=PLUGIN_NAMESPACE,
                                   plugin_version=PLUGIN_VERSION)
    return out, kv_out


def translation_table() -> dict:
    """What to pass as `torch.onnx.export(custom_translation_table=...)`."""
    return {torch.ops.trtforge.paged_attention_export.default: _translate}


@contextlib.contextmanager
def redirect_paged_attention(sink: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, `torch.ops.trtforge.paged_attention` calls the functional export op
    and appends each layer's updated pool to `sink` (in call order = layer order).

    Only for tracing an export in this thread: the namespace attribute is swapped and put back.
    """
    namespace = torch.ops.trtforge
    original = namespace.paged_attention

    def functional(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                   scale, softcap=0.0, window=0):
        # window (sliding-window layers) is dropped: the ONNX node and the TensorRT plugin have none, and the
        # tensorrt build caps max_seq_len at the model's smallest window (builder/build_config.py), where every
        # position of a sequence is inside every layer's window, so full causal attention is the same.
        if softcap:
            raise ValueError("the ONNX PagedAttention node (and the TensorRT plugin) has no attention soft-capping "
                             "(attn_logit_softcapping, Gemma 2): a soft-capped network cannot be exported; run it "
                             "with --backend torch")
        out, kv_out = torch.ops.trtforge.paged_attention_export(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale)
        sink.append(kv_out)
        return out

    namespace.paged_attention = functional
    try:
        yield
    finally:
        namespace.paged_attention = original
