"""The ONNX Runtime PyOp for `trtforge::PagedAttention` against the plain-PyTorch reference."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

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
from trtforge.plugins.paged_attention.onnx_ort import make_session
from trtforge.plugins.paged_attention.testing import make_case


def single_node_graph(path, case) -> None:
    """A graph holding only one PagedAttention node, typed from the case's tensors."""
    types = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64,
             torch.int32: TensorProto.INT32}
    tensors = dict(zip(INPUT_NAMES, case.op_args()[:-1]))
    inputs = [helper.make_tensor_value_info(n, types[t.dtype], [None] * t.dim())
              for n, t in tensors.items()]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUT_NAMES]
    node = helper.make_node(OP_TYPE, list(INPUT_NAMES), list(OUTPUT_NAMES),
                            domain=DOMAIN, scale=case.scale, plugin_namespace=PLUGIN_NAMESPACE,
                            plugin_version=PLUGIN_VERSION)
    graph = helper.make_graph([node], "one_node", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    onnx.save(model, path)


def test_pyop_matches_reference_on_mixed_batch(tmp_path):
    # A prompt chunk after cached context, a fresh prompt and a decode token, GQA 4:2.
    case = make_case([(5, 3), (0, 6), (9, 1)], block_size=4, seed=3)
    single_node_graph(tmp_path / "node.onnx", case)
    session = make_session(tmp_path / "node.onnx")
    feed = {n: t.numpy() for n, t in zip(INPUT_NAMES, case.op_args()[:-1])}
    out, kv_out = session.run(list(OUTPUT_NAMES), feed)

    expected_kv = case.kv_cache.clone()
    m = case.meta
    expected = reference.paged_attention(case.q, case.k, case.v, expected_kv, m.slot_mapping,
                                         m.block_tables, m.seq_lens, m.query_start_loc, case.scale)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kv_out, expected_kv.numpy(), rtol=0, atol=0)
    # The PyOp cannot update its input: the pool fed in is unchanged, the new one is an output.
    np.testing.assert_array_equal(feed["kv_cache"], case.kv_cache.numpy())
    assert not np.array_equal(kv_out, feed["kv_cache"])
