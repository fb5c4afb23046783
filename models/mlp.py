"""The decoder's feed-forward block: a gated MLP `down(act(gate(x)) * up(x))` (SwiGLU, GeGLU) or a plain
`down(act(up(x)))` (GPT-2). The dense layers' MLP, and also each expert and the shared expert of an MoE
block (models/moe.py), which are the same gated MLP with their own width and layer path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtforge.models.layers import Layers
from trtforge.models.model_config import ModelConfig
from trtforge.models.quantized_layers import QuantLinear
from trtforge.plugins.cpu import fused as cpu_fused, workspace
from trtforge.plugins.cpu.linear import CpuLinear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """width: the intermediate size (default cfg.intermediate_size); prefix: the path of its linears inside a
    decoder layer, which decides whether --quantization quantizes them (models/quantized_layers.py)."""

    def __init__(self, cfg: ModelConfig, layers: Layers, width: int | None = None, prefix: str = "mlp"):
        super().__init__()
        width = width or cfg.intermediate_size
        self.gated = cfg.gated_mlp
        self.act = ACTIVATIONS[cfg.activation]
        if self.gated:
            self.gate_up = layers.linear(f"{prefix}.gate_up", cfg.hidden_size, 2 * width, cfg.mlp_bias)
        else:
            self.up = layers.linear(f"{prefix}.up", cfg.hidden_size, width, cfg.mlp_bias)
        self.down = layers.linear(f"{prefix}.down", width, cfg.hidden_size, cfg.mlp_bias)
        self.fused_silu = layers.fused_ops and self.act is F.silu
        self.reuse_gate_up = self.gated and self.fused_silu and isinstance(self.gate_up, (CpuLinear, QuantLinear))
        """The packed float32 or quantized gate/up writes into a reused buffer (plugins/cpu/workspace.py: a
        prefill chunk's product is tens of MB, which fresh pages make slow); so does the fused SiLU·mul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            reuse = cpu_fused.native_ok(x)  # eager float32 CPU: a thread's scratch holds both temporaries
            if reuse and self.reuse_gate_up:
                buf = workspace.scratch("mlp.gate_up", (*x.shape[:-1], self.gate_up.out_features), x)
                gate_up = self.gate_up(x, out=buf)
            else:
                gate_up = self.gate_up(x)  # [T, 2I]
            h = None
            if self.fused_silu:  # one C loop
                out = workspace.scratch("mlp.act", (*x.shape[:-1], gate_up.shape[-1] // 2), x) if reuse else None
                h = cpu_fused.silu_mul(gate_up, out=out)
            if h is None:
                gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
                h = self.act(gate) * up
            return self.down(h)
        return self.down(self.act(self.up(x)))
