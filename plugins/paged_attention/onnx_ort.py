"""ONNX Runtime implementation of the `trtforge::PagedAttention` node, for checking exports on CPU.

TensorRT runs the exported graph with the `trtforge::PagedAttention` plugin (tensorrt_plugin.py);
to check the same graph numerically without a GPU, this module registers an
onnxruntime-extensions Python custom op ("PyOp") for the node and runs it with the plain-PyTorch
reference. fp32 only and slow (every output is copied through a Python list): tiny models only.

A PyOp cannot update its input in place, so the node's second output (present KV) is a fresh
copy of the pool with the new tokens written; whoever runs the graph feeds it back as the next
step's KV input. In TensorRT the plugin aliases that output to the KV input instead.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from trtforge.plugins.paged_attention.names import QUALIFIED_NAME
from trtforge.plugins.paged_attention.reference import paged_attention as reference_paged_attention


def _run_node(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
              **attrs):
    """The PyOp body: numpy in, numpy out, via the reference op on a copy of the pool."""
    kv = torch.from_numpy(np.array(kv_cache, copy=True))
    out = reference_paged_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), kv,
        torch.from_numpy(slot_mapping), torch.from_numpy(block_tables),
        torch.from_numpy(seq_lens), torch.from_numpy(query_start_loc), float(attrs["scale"]))
    return out.numpy(), kv.numpy()


@functools.cache
def register_pyop() -> str:
    """Register the PyOp once per process; returns the custom-op library path for ORT.

    Raises ImportError with the install command when onnxruntime-extensions is missing.
    """
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "checking an ONNX export on CPU needs onnxruntime and onnxruntime-extensions: "
            "pip install 'trtforge[onnx]'") from exc
    f32, i64, i32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64, PyCustomOpDef.dt_int32
    onnx_op(
        op_type=QUALIFIED_NAME,  # onnxruntime-extensions spells it domain::op_type
        inputs=[f32, f32, f32, f32, i64, i32, i32, i32],
        outputs=[f32, f32],
        # plugin_namespace / plugin_version are for TensorRT's ONNX parser; declared so the
        # node's attributes all have a type here too.
        attrs={"scale": PyCustomOpDef.dt_float, "plugin_namespace": PyCustomOpDef.dt_string,
               "plugin_version": PyCustomOpDef.dt_string},
    )(_run_node)
    return get_library_path()


def make_session(model_path: str | Path):
    """An ONNX Runtime CPU session for a graph containing `trtforge::PagedAttention` nodes."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(register_pyop())
    # The PyOp holds the GIL; extra intra-op threads only contend on a small CPU.
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
