"""TensorRT plugin `trtforge::PagedAttention` (Quickly Deployable Plugin, TensorRT >= 10.6).

Importing this module registers the plugin with TensorRT's plugin registry, which is what the
ONNX parser consults for the exported graph's `trtforge::PagedAttention` nodes (op_type =
plugin name, `plugin_namespace` / `plugin_version` attributes; `scale` becomes the plugin's
one field) and what deserialising a plan needs. Import it before parsing or loading.

Inputs and outputs are those of the ONNX node (the op contract, op.py):

    q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc  ->  out, kv_cache_out

`kv_cache_out` is *aliased* to `kv_cache` (`TensorDesc.aliased()`): TensorRT hands the plugin
the same buffer for both and the Triton kernels update the pool in place, so the runtime binds
`kv_cache_{i}` and `kv_cache_out_{i}` to one allocation. That needs the builder preview feature
ALIASED_PLUGIN_IO_10_03 (builder/tensorrt/build.py sets it).

The implementation launches the OpenAI-Triton kernels of `triton_kernels.py` on TensorRT's
stream. The kernels want host-side maxima (max new tokens per sequence, longest context) to size
their grids; reading them from device memory would cost a sync per layer, so the plugin passes
upper bounds derived from shapes alone: every sequence in the batch has at least one new token,
so max_query_len <= T - S + 1 (exactly 1 in a pure decode batch), and a context never exceeds
its block-table row, so max_seq_len <= W * block_size.
"""

# No `from __future__ import annotations` here: `tensorrt.plugin` reads these functions'
# annotations with `inspect.signature` and checks them with `issubclass` / `typing.get_origin`
# (`_parse_register_inputs`, `_parse_register_return`, `_validate_impl` in
# tensorrt/plugin/_validate.py, TensorRT 10.6 through 11.1), so string annotations make
# `@trtp.register` raise "issubclass() arg 1 must be a class" at import.

import contextlib
from typing import Iterator, Tuple

import numpy as np
import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from trtforge.plugins.paged_attention.names import (
    QUALIFIED_NAME as PLUGIN_ID,  # namespace::name, as the registry knows it
)
from trtforge.plugins.paged_attention.triton_kernels import paged_attention_triton

_TORCH_DTYPES = {trt.float32: torch.float32, trt.float16: torch.float16,
                 trt.bfloat16: torch.bfloat16, trt.int32: torch.int32, trt.int64: torch.int64}

_builds_in_progress = 0


@contextlib.contextmanager
def building_engine() -> Iterator[None]:
    """Wrap `builder.build_serialized_network`: while it runs, the impl touches no KV pool.

    TensorRT times layers on fake input data while it builds (a maintainer's word in
    NVIDIA/TensorRT#2552), and the QDP impl is what it times. Fake slot ids and block ids would
    send the Triton kernels' scatter and gathers to arbitrary addresses, so during a build the
    impl only zero-fills `out`; the plugin has one format combination and no tactics, so there
    is nothing for the timing to choose.
    """
    global _builds_in_progress
    _builds_in_progress += 1
    try:
        yield
    finally:
        _builds_in_progress -= 1


class _CudaArray:
    """A `__cuda_array_interface__` over a TensorRT buffer, for dtypes numpy cannot name.

    `trtp.Tensor` refuses the interface for bf16 (numpy has no bf16); expose the bits as int16
    and reinterpret on the torch side, which is free.
    """

    def __init__(self, tensor: trtp.Tensor, typestr: str, itemsize: int):
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": typestr, "version": 3,
            "data": (tensor.data_ptr, False),
            "strides": tuple(s * itemsize for s in tensor.strides),
            "stream": None,  # same stream as the caller: no synchronisation wanted
        }


def as_torch(tensor: trtp.Tensor) -> torch.Tensor:
    """Zero-copy torch view of a TensorRT plugin tensor on the current CUDA device."""
    if tensor.dtype == trt.bfloat16:
        return torch.as_tensor(_CudaArray(tensor, "<i2", 2), device="cuda").view(torch.bfloat16)
    if tensor.dtype not in _TORCH_DTYPES:
        raise TypeError(f"{PLUGIN_ID}: unsupported tensor dtype {tensor.dtype}")
    return torch.as_tensor(tensor, device="cuda")


@trtp.register(PLUGIN_ID)
def paged_attention_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc,
                         kv_cache: trtp.TensorDesc, slot_mapping: trtp.TensorDesc,
                         block_tables: trtp.TensorDesc, seq_lens: trtp.TensorDesc,
                         query_start_loc: trtp.TensorDesc,
                         scale: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """Output shapes/dtypes: attention output like q; the KV pool aliased to the input pool."""
    return q.like(), kv_cache.aliased()


@trtp.impl(PLUGIN_ID)
def paged_attention_impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, kv_cache: trtp.Tensor,
                         slot_mapping: trtp.Tensor, block_tables: trtp.Tensor,
                         seq_lens: trtp.Tensor, query_start_loc: trtp.Tensor, scale: float,
                         outputs: Tuple[trtp.Tensor], stream: int) -> None:
    """Write k/v into the (aliased) pool and attend, on TensorRT's stream."""
    out, pool = as_torch(outputs[0]), as_torch(outputs[1])  # pool: same memory as kv_cache
    tq, tk, tv = as_torch(q), as_torch(k), as_torch(v)
    tables = as_torch(block_tables)
    num_tokens, num_seqs = tq.shape[0], tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        if _builds_in_progress:  # timing run on fake inputs: see building_engine()
            out.zero_()
            return
        result = paged_attention_triton(
            tq, tk, tv, pool, as_torch(slot_mapping), tables, as_torch(seq_lens),
            as_torch(query_start_loc), float(np.float32(scale)),
            max_query_len=max(1, num_tokens - num_seqs + 1),
            max_seq_len=tables.shape[1] * pool.shape[2])
        # The kernels allocate their own output; one [T, Hq, D] copy per layer is small next
        # to attention itself.
        out.copy_(result)
