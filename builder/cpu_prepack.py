"""Run the network's linear layers through oneDNN on CPU (float32).

Why: PyTorch's CPU `F.linear` calls MKL, whose fp32 GEMM for the shapes of LLM decoding (few rows,
K = hidden) is slow on AMD processors and barely uses a second thread. oneDNN (`mkldnn_linear`,
weights pre-packed once with `to_mkldnn`) measured on the project's 2-core AMD EPYC for a
[16 × 896] × [896 × 9728] product: 6.1 ms vs 14.2 ms (2.3×), and 2.1 vs 3.8 ms at one row.
Same math in another summation order: logits agree with MKL's to ~1e-6.

The weights are reordered once into oneDNN's blocked layout for one-row products
(`_reorder_linear_weight(w, 1)`, inductor's CPU linear packing) and called with dense inputs and
outputs (`_linear_pointwise`), so no per-call layout conversion happens: on the same machine that
is as fast for one row (2.0 ms), 10 % slower for 16 rows and 22 % faster for 256-row prefill chunks
than `torch.utils.mkldnn.MkldnnLinear`, which this falls back to where those ops are missing.

The tied LM head gets its own packed copy (the embedding lookup keeps the dense table), which
costs one more copy of that matrix in memory.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.mkldnn import MkldnnLinear


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed for oneDNN; dense float32 in and out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _pack(linear: nn.Linear) -> nn.Module:
    if hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return PackedLinear(linear)
    return MkldnnLinear(linear, torch.float32)

ENV_VAR = "TRTFORGE_CPU_ONEDNN"


def onednn_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN for float32 on CPU, unless TRTFORGE_CPU_ONEDNN=0 or this torch lacks it."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and os.environ.get(ENV_VAR, "1") != "0")


def prepack_linears(network: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `network` (and its LM head) by a oneDNN-packed equivalent, in place."""
    head = nn.Linear(network.cfg.hidden_size, network.cfg.vocab_size, bias=False)
    head.weight = nn.Parameter(network.lm_head_weight().detach(), requires_grad=False)
    network.packed_head = _pack(head)
    if not network.cfg.tie_word_embeddings:
        del network.lm_head  # its packed copy replaces it
    for parent in list(network.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, _pack(child))
    return network
