"""Export a trtforge network to ONNX: one graph for prefill and decode, for TensorRT.

Graph interface (names are the contract with `serving/worker/trt_executor.py` and `onnx_verify.py`):

    inputs   input_ids        int64 [T]            packed new tokens of S sequences
             positions        int64 [T]
             slot_mapping     int64 [T]
             block_tables     int32 [S, W]
             seq_lens         int32 [S]
             query_start_loc  int32 [S+1]
             logits_indices   int64 [S']           rows of T whose logits are wanted
             kv_cache_{i}     dtype [2, N, block_size, Hkv, D]   layer i's KV pool
    outputs  logits           float32 [S', V]
             kv_cache_out_{i} dtype [2, N, block_size, Hkv, D]   the pool after this step

T, S, W, N and S' are dynamic; everything else (layers, heads, block size, dtypes) is baked in,
because TensorRT 11 builds strongly typed networks from the dtypes in the file. Each layer's
attention is exactly one `trtforge::PagedAttention` node (plugins/paged_attention/onnx_export.py).
Weights go to an external-data file when the model is over ONNX's 2 GB protobuf limit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from trtforge.models.errors import BuildError
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.plugins.paged_attention.names import DOMAIN, OP_TYPE, QUALIFIED_NAME
from trtforge.plugins.paged_attention.onnx_export import redirect_paged_attention, translation_table

log = logging.getLogger(__name__)

META_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
               "query_start_loc", "logits_indices")
LOGITS = "logits"


def kv_input_name(layer: int) -> str:
    return f"kv_cache_{layer}"


def kv_output_name(layer: int) -> str:
    return f"kv_cache_out_{layer}"


def input_names(num_layers: int) -> list[str]:
    return [*META_INPUTS, *(kv_input_name(i) for i in range(num_layers))]


def output_names(num_layers: int) -> list[str]:
    return [LOGITS, *(kv_output_name(i) for i in range(num_layers))]


class ExportWrapper(nn.Module):
    """The network with flat tensor inputs and the layers' updated KV pools as outputs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens,
                query_start_loc, logits_indices, kv_caches: tuple[torch.Tensor, ...]):
        # max_query_len / max_seq_len are host-side hints the network never reads; the real
        # values are data in a traced graph.
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 seq_lens=seq_lens, query_start_loc=query_start_loc,
                                 max_query_len=0, max_seq_len=0)
        kv_outs: list[torch.Tensor] = []
        with redirect_paged_attention(kv_outs):
            logits = self.model(input_ids, positions, list(kv_caches), meta, logits_indices)
        return (logits, *kv_outs)


def example_inputs(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype) -> tuple:
    """A mixed batch to trace with: a 4-token prompt chunk after 3 cached tokens + 1 decode.

    Every dynamic dimension gets a size >= 2 and distinct from the others, so torch.export
    neither specialises it to 0/1 nor assumes two dimensions are equal.
    """
    seqs = [(3, 4), (6, 1)]  # (cached, new)
    width = 3  # block-table columns
    num_blocks = 2 * width + 1
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    ids, positions, slots = [], [], []
    for s, (cached, new) in enumerate(seqs):
        for p in range(cached, cached + new):
            ids.append(p % 7)
            positions.append(p)
            slots.append(int(tables[s, p // block_size]) * block_size + p % block_size)
    new_lens = [n for _, n in seqs]
    query_start_loc = torch.tensor([0, *new_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    logits_indices = query_start_loc[1:].long() - 1
    kv = tuple(torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
               for _ in range(num_layers))
    return (torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), tables,
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32), query_start_loc,
            logits_indices, kv)


def dynamic_shapes(num_layers: int) -> tuple:
    """torch.export dims of `ExportWrapper.forward`'s arguments, positionally."""
    dim = torch.export.Dim
    tokens, seqs, width = dim("num_tokens", min=1), dim("num_seqs", min=1), dim("max_blocks_per_seq", min=1)
    blocks, rows = dim("num_blocks", min=1), dim("num_logits", min=1)
    pool = {1: blocks}
    return ({0: tokens}, {0: tokens}, {0: tokens}, {0: seqs, 1: width}, {0: seqs},
            {0: seqs + 1}, {0: rows}, tuple(pool for _ in range(num_layers)))


def export_onnx(model: nn.Module, out_path: str | Path, *, block_size: int) -> Path:
    """Trace `model` (a CausalLM) and write `out_path` (+ `<name>.data` when over 2 GB).

    The model's parameter dtype becomes the graph's activation and KV dtype.
    """
    cfg = model.cfg
    if cfg.attn_logit_softcapping:
        raise BuildError(f"{cfg.architecture} soft-caps its attention scores (attn_logit_softcapping "
                         f"{cfg.attn_logit_softcapping}), which the ONNX PagedAttention node and the TensorRT "
                         f"plugin do not take: export and --backend tensorrt are refused; use --backend torch.")
    if cfg.num_experts:
        raise BuildError(f"{cfg.architecture} is a Mixture-of-Experts model ({cfg.num_experts} experts, top-"
                         f"{cfg.num_experts_per_tok}): its routing (experts grouped by the tokens that chose them) "
                         f"is not exported to ONNX / TensorRT; export and --backend tensorrt are refused; use "
                         f"--backend torch.")
    out_path = Path(out_path)
    dtype = next(model.parameters()).dtype
    args = example_inputs(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)
    wrapper = ExportWrapper(model).eval()
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper, args, dynamo=True, dynamic_shapes=dynamic_shapes(cfg.num_layers),
            input_names=input_names(cfg.num_layers), output_names=output_names(cfg.num_layers),
            custom_translation_table=translation_table(), verbose=False)
    if program is None:  # pragma: no cover - only the legacy exporter returns None
        raise BuildError("torch.onnx.export returned no program; trtforge needs the dynamo exporter "
                         "(torch >= 2.6)")
    program.model.metadata_props.update({
        "trtforge.architecture": cfg.architecture, "trtforge.num_layers": str(cfg.num_layers),
        "trtforge.kv_block_size": str(block_size), "trtforge.dtype": str(dtype).removeprefix("torch."),
    })
    out_path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # protobuf refuses messages over 2 GiB; keep a margin for the graph itself.
    program.save(out_path, external_data=weight_bytes > 1.8 * 2**30)
    log.info("wrote %s (%.1f MB of weights)", out_path, weight_bytes / 1e6)
    return out_path


def check_graph(path: str | Path, num_layers: int) -> dict[str, int]:
    """onnx.checker plus the plugin contract: exactly one `trtforge::PagedAttention` per layer,
    no other custom-domain node, the expected inputs/outputs. Returns op-type counts.

    Raises BuildError naming what is wrong.
    """
    import onnx

    path = Path(path)
    onnx.checker.check_model(str(path))  # by path: works for external data too
    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        counts[key] = counts.get(key, 0) + 1
        if node.domain not in ("", "ai.onnx") and (node.domain, node.op_type) != (DOMAIN, OP_TYPE):
            raise BuildError(f"{path}: unexpected custom node {key} ({node.name}); TensorRT only "
                             f"has a plugin for {QUALIFIED_NAME}")
    found = counts.get(QUALIFIED_NAME, 0)
    if found != num_layers:
        raise BuildError(f"{path}: {found} {QUALIFIED_NAME} nodes for {num_layers} layers; "
                         "re-export with `trtforge export-onnx`")
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if got_in != input_names(num_layers) or got_out != output_names(num_layers):
        raise BuildError(f"{path}: graph inputs {got_in} / outputs {got_out} are not trtforge's "
                         "interface; re-export with `trtforge export-onnx`")
    return counts

