"""The decoder's linear layers with weight-only quantized weights (build-engine --quantization).

Which layers: the ones the network fuses — attention's qkv and o_proj, the MLP's gate_up (or up) and
down. Embeddings, the LM head, norms and biases stay in the engine dtype: the head is the one layer
whose error reaches the logits unmixed, and embeddings are only gathered a row at a time.

How a `QuantLinear` computes (the quantisation math: plugins/cpu/quant_linear.py):
  * float32 on CPU, ≤ GEMV_MAX_ROWS rows (decode): the C kernel, dequantising in registers;
  * float32 on CPU, more rows (prefill): the weights dequantised by a C loop into a float32 scratch
    buffer, then oneDNN's GEMM (as CpuLinear; plain F.linear where this torch lacks it) — the GEMM
    is compute-bound there, so one extra pass over the weights costs little;
  * anything else (CUDA, float16/bfloat16, autograd, no compiler): the reference — dequantise in
    torch, then F.linear. CUDA engines run this way: correct, but without a fused kernel.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trtforge.plugins.cpu import quant_linear as ql
from trtforge.plugins.cpu.linear import GEMV_MAX_ROWS, cpu_linears_wanted, onednn_linear

from .model_config import ModelConfig

QUANTIZED_LAYERS = ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.up", "mlp.down")
"""Module paths inside a decoder layer whose weights are quantized (those the network has)."""

_scratch = threading.local()  # one float32 buffer per thread for prefill's dequantised weights


def _scratch_for(n: int, k: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k)
    return buf[: n * k].view(n, k)


class QuantLinear(nn.Module):
    """y = x dequantize(qweight, scales)^T + bias. State: `qweight`, `scales` (float32), `bias`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, group_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group = scheme, group_size if scheme == "int4_wo" else 0
        if scheme == "int8_wo":
            q_shape, s_shape, q_dtype = (out_features, in_features), (out_features,), torch.int8
        else:
            q_shape, s_shape, q_dtype = (out_features, in_features // 2), (out_features, in_features // group_size), torch.uint8
        self.register_buffer("qweight", torch.empty(q_shape, dtype=q_dtype))
        self.register_buffer("scales", torch.empty(s_shape, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def extra_repr(self) -> str:
        group = f", group_size={self.group}" if self.group else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}"

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ql.dequantize(self.qweight, self.scales, self.scheme, self.group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ql.kernel_ok(x, self.in_features, self.group or 8):
            if x.numel() // self.in_features <= GEMV_MAX_ROWS:
                return ql.gemv(x, self.qweight, self.scales, self.bias, self.scheme, self.group)
            w = ql.dequantize_into(_scratch_for(self.out_features, self.in_features), self.qweight, self.scales,
                                   self.scheme, self.group)
            if cpu_linears_wanted(x.device, x.dtype):
                return onednn_linear(x, w, self.bias)
            return F.linear(x, w, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)  # the reference


def quantized_in_features(cfg: ModelConfig) -> dict[str, int]:
    """{layer path: in_features} of the layers --quantization touches, for the build's shape checks."""
    mlp = "mlp.gate_up" if cfg.gated_mlp else "mlp.up"
    return {"attn.qkv": cfg.hidden_size, "attn.o_proj": cfg.q_size, mlp: cfg.hidden_size,
            "mlp.down": cfg.intermediate_size}


def quantize_layers(network: nn.Module, quantization: dict[str, Any]) -> nn.Module:
    """Replace the decoder's nn.Linear layers named in QUANTIZED_LAYERS by QuantLinears of the same
    shape (engine.json's `quantization`: scheme, group_size), in place; build on meta, then load."""
    for layer in network.layers:
        for path in QUANTIZED_LAYERS:
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            old = getattr(parent, name, None)
            if isinstance(old, nn.Linear):
                setattr(parent, name, QuantLinear(old.in_features, old.out_features, old.bias is not None,
                                                  quantization["scheme"], int(quantization.get("group_size") or 0)))
    return network


def is_quantized_weight(name: str) -> bool:
    """Whether converted tensor `name` (e.g. layers.3.attn.qkv.weight) is one --quantization stores packed."""
    parts = name.split(".")
    return (len(parts) == 5 and parts[0] == "layers" and parts[-1] == "weight"
            and ".".join(parts[2:4]) in QUANTIZED_LAYERS)
