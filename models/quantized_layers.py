"""The decoder's linear layers with weight-only quantized weights (build-engine --quantization).

Which layers: the ones the network fuses — attention's qkv and o_proj, the MLP's gate_up (or up) and
down — and, unless built with --no-quantize-lm-head, the LM head: int8 with one scale per vocabulary
row whatever the scheme by default (the head's error reaches the logits unmixed, so it gets the finer step;
--lm-head-quantization int4_wo makes it int4 per group instead;
for a 0.5B model with a 151936-row tied head the float32 head was 60-74 % of a quantized decode
step's bytes). It is the network's `head_linear`, stored as `head_linear.qweight`/`.scales`. A tied
head is the embedding table: `QuantEmbedding` then looks tokens up in the same int8 rows and
dequantises them (each embedding off by at most its row's scale / 2), so no float copy is kept.
Norms, biases and an untied embedding table stay in the engine dtype (embeddings are only gathered
a row at a time).

The network builds these layers in place of nn.Linear where engine.json's `quantization` asks for
them (models/layers.py: Layers.linear / quantized_head), with the kernels the registry chose
(plugins/kernels.py: `quant_linear`, `quant_activations`, `linear`).

How a `QuantLinear` computes (the quantisation math: plugins/cpu/quant_linear.py):
  * float32 on CPU, any number of rows: the C kernel with the activation rows quantised to int8 per
    block of 32 and integer dot products (W8A8 / W4A8) — decode steps and prefill chunks alike: on
    the 2-core AMD EPYC (Zen 3) it is 1.1-3.5x as fast as the dequantise + oneDNN float32 GEMM
    below at every row count measured (16-2048 rows of Qwen2.5-0.5B's four linears:
    scripts/bench_quant_gemm.py, numbers in docs/quantization.md), and it never writes a float32
    copy of the weights;
  * quant_activations "float" (TRTFORGE_QUANT_ACTIVATIONS=float) or a K / int4 group that is not a multiple of 32: float
    activations — up to GEMV_MAX_ROWS rows the C kernel dequantising the weights in registers, more
    rows the weights dequantised by a C loop into a float32 scratch buffer, then oneDNN's GEMM (as
    CpuLinear; plain F.linear where the registry's `linear` is "torch");
  * anything else (quant_linear "torch": CUDA, float16/bfloat16; or autograd, no compiler): the
    reference — dequantise in torch, then F.linear. CUDA engines run this way: correct, but without
    a fused kernel.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trtforge.models.model_config import ModelConfig
from trtforge.plugins import kernels as registry
from trtforge.plugins.cpu import quant_linear as ql
from trtforge.plugins.cpu.linear import onednn_linear
from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS

QUANTIZED_LAYERS = ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.up", "mlp.down", "mlp.experts.gate_up",
                    "mlp.experts.down", "mlp.shared_expert.gate_up", "mlp.shared_expert.down")
"""Module paths inside a decoder layer whose weights are quantized (those the network has). An MoE block's
experts (`mlp.experts.{e}.gate_up`, named without the expert index here) and shared expert are; its router
and shared-expert gate stay in the engine dtype (they are [E, H] and [1, H], and they decide the routing)."""

_scratch = threading.local()  # one float32 buffer per thread for prefill's dequantised weights


def _scratch_for(n: int, k: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k)
    return buf[: n * k].view(n, k)


class QuantLinear(nn.Module):
    """y = x dequantize(qweight, scales)^T + bias. State: `qweight`, `scales` (float32), `bias`.
    kernels: the registry's choice it runs (None: `kernels.choose("cpu", torch.float32)`'s)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, group_size: int,
                 kernels: registry.Kernels | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group = scheme, group_size if scheme == "int4_wo" else 0
        if scheme == "int8_wo":
            q_shape, s_shape, q_dtype = (out_features, in_features), (out_features,), torch.int8
        else:
            q_shape, q_dtype = (out_features, in_features // 2), torch.uint8
            s_shape = (out_features, in_features // group_size)
        self.register_buffer("qweight", torch.empty(q_shape, dtype=q_dtype))
        self.register_buffer("scales", torch.empty(s_shape, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("zeros", None)  # pre-quantized checkpoints' layers only: `_load_from_state_dict`
        self.register_buffer("perm", None)
        kernels = kernels or registry.choose("cpu", torch.float32)
        self.c_kernels = kernels.quant_linear == "cpu"
        """Whether the C kernels run where they can (float32 CPU eager inference); else the reference."""
        self.native = self.c_kernels
        """Whether a caller may run this layer on the C kernels directly, as the CPU decode plan does — with a
        pre-quantized layer's zero points and input permutation (`zeros`, `perm`) around the kernel as `forward`
        adds them (the plan by quant_linear.c's helpers: `zero_scales_t`, `perm`)."""
        self.a8 = kernels.quant_activations == "int8" and ql.a8_ok(in_features, scheme, self.group)
        """Whether the C GEMV quantises the activations to int8 (any row count) or keeps them float."""
        self._dense = onednn_linear if kernels.linear == "cpu" else F.linear
        """The GEMM of float-activation prefill, on weights dequantised into a scratch buffer."""
        self.gemv_only = False
        """Never dequantise the whole layer (the LM head: a float32 copy of it would be as big as the
        memory quantising it saves): with float activations, more rows run the GEMV GEMV_MAX_ROWS
        rows at a time (the int8-activation kernel takes any number of rows anyway)."""

    zeros: torch.Tensor | None
    """Pre-quantized asymmetric checkpoints (GPTQ sym=false, AWQ, compressed-tensors with zero points): int8
    [N, G] zero points in the codes' domain, w = (q - zero) · scale (G = K / group; 1 for int8_wo). The kernels
    run on the codes and `quant_linear.zero_point_correction` (its C helper here: `zero_point_correction_into`) takes
    Σ_g (scale · zero) · Σ_group x off."""
    perm: torch.Tensor | None
    """Pre-quantized GPTQ act-order (desc_act): int64 [K], the input each weight column holds (columns sorted
    by group, so groups are contiguous); the input is gathered x[..., perm] first."""
    _zero_scales: torch.Tensor | None = None
    _zero_scales_t: torch.Tensor | None = None

    def zero_scales(self) -> torch.Tensor:
        """float32 [N, G] = scale · zero (exact: a small integer times a scale) of a layer with `zeros`, cached."""
        if self._zero_scales is None:
            self._zero_scales = self.scales.view(self.out_features, -1) * self.zeros.view(self.out_features, -1).float()
        return self._zero_scales

    def zero_scales_t(self) -> torch.Tensor:
        """`zero_scales` transposed, contiguous [G, N]: the layout of quant_linear.c's correction helper."""
        if self._zero_scales_t is None:
            self._zero_scales_t = self.zero_scales().t().contiguous()
        return self._zero_scales_t

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """`zeros` and `perm` exist where the engine file has them (pre-quantized checkpoints' layers)."""
        for name in ("zeros", "perm"):
            t = state_dict.get(prefix + name)
            if t is not None and self._buffers.get(name) is None:
                self.register_buffer(name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.scheme == "int8_wo" and self.a8 and prefix + "qweight" in state_dict \
                and not self.qweight.is_meta and int(self.qweight.min()) < -127:
            # a pre-quantized int8 code of -128: the AVX2 int8-activation kernel carries x's sign on the
            # weight (vpsignb), which -128 does not survive; the float-activation kernels take it
            self.a8 = False

    def extra_repr(self) -> str:
        group = f", group_size={self.group}" if self.group else ""
        acts = "int8" if self.a8 else "float"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}, "
                f"{'C kernels' if self.native else 'reference'}, {acts} activations")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (columns in `perm`'s order where the layer has one)."""
        q = self.qweight if self.qweight is not None else ql.unpack_int8_vnni(self.vnni[0], self.out_features)
        return ql.dequantize(q, self.scales, self.scheme, self.group, dtype, self.zeros)

    vnni: tuple[torch.Tensor, torch.Tensor] | None = None
    """int8 weights packed in the VNNI layout for the packed int8 GEMM (`pack_weights`), else None."""

    def pack_weights(self) -> None:
        """At load: an int8 layer on int8-activation C kernels packs its weights for the packed int8 GEMM
        where this build has one (`ql.panels_kernel`: AVX-512 VNNI, 5.9x the AVX2 row kernels' rate at
        64 rows on one core; AVX2 on the same layout, 1.1-1.3x them on an AVX2-only EPYC);
        the row-major qweight is then dropped, except the LM head's (a tied head's embeddings read
        its rows); the reference path unpacks it when it runs."""
        if (self.vnni is None and self.scheme == "int8_wo" and self.a8 and self.c_kernels and self.qweight is not None
                and not self.qweight.is_meta and self.qweight.device.type == "cpu" and ql.panels_kernel()):
            self.vnni = ql.pack_int8_vnni(self.qweight)
            if not self.gemv_only:  # a decoder layer, not the head
                self.qweight = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a contiguous float32 tensor of y's shape that the int8-activation and GEMV kernels write y
        into (a reused buffer, plugins/cpu/workspace.py); the other paths return a new tensor instead, so
        the caller uses what is returned."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.c_kernels and ql.kernel_ok(x, self.in_features, self.group or 8):
            y = self._kernel(x, out)
            if self.zeros is not None:  # quant_linear.c's helper, as the CPU decode plan calls it
                ql.zero_point_correction_into(y.view(-1, self.out_features), x.reshape(-1, self.in_features),
                                              self.zero_scales_t())
            return y
        return F.linear(x, self.dequantized(x.dtype), self.bias)  # the reference

    def _kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x · (q · scale)ᵀ + bias by the C kernels (zero points are not theirs: `forward` adds them)."""
        if self.vnni is not None:
            return ql.gemm_int8_vnni(x, *self.vnni, self.scales, self.bias, self.out_features, out=out)
        rows = x.numel() // self.in_features
        if rows <= GEMV_MAX_ROWS or self.a8:
            return ql.gemv(x, self.qweight, self.scales, self.bias, self.scheme, self.group,
                           "int8" if self.a8 else "float", out=out)
        if self.gemv_only:
            flat = x.reshape(rows, self.in_features)
            return torch.cat([ql.gemv(flat[i:i + GEMV_MAX_ROWS], self.qweight, self.scales, self.bias,
                                      self.scheme, self.group, "float") for i in range(0, rows, GEMV_MAX_ROWS)]
                             ).view(*x.shape[:-1], self.out_features)
        w = ql.dequantize_into(_scratch_for(self.out_features, self.in_features), self.qweight, self.scales,
                               self.scheme, self.group)
        return self._dense(x, w, self.bias)


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized tied LM head: int8 with one scale per vocabulary row
    (row t = qweight[t] * scales[t]) or int4 per group (the looked-up rows unpacked, each group times
    its scale), in `dtype`. Holds no tensors of its own (the head owns them)."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self._head = (head,)  # a tuple: not a submodule, so the state dict names the tensors once
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        head = self._head[0]
        rows = head.qweight.index_select(0, input_ids)
        scales = head.scales.index_select(0, input_ids).unsqueeze(-1)
        if head.scheme == "int4_wo":  # [T, K/2] packed → [T, groups, group] codes
            t = rows.shape[0]
            rows = ql.unpack_int4(rows).view(t, -1, head.group)
            if out is not None:
                torch.mul(rows, scales, out=out.view(t, -1, head.group))
                return out
            return (rows * scales).view(t, -1).to(self.dtype)
        if out is not None:  # float32 [T, H] (the CPU decode plan's buffer)
            return torch.mul(rows, scales, out=out)
        return (rows * scales).to(self.dtype)


def quantized_in_features(cfg: ModelConfig) -> dict[str, int]:
    """{layer path: in_features} of the layers --quantization touches, for the build's shape checks."""
    mlp = "mlp.gate_up" if cfg.gated_mlp else "mlp.up"
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    shapes = {"attn.qkv": cfg.hidden_size, "attn.o_proj": cfg.q_size}
    if dense:
        shapes.update({mlp: cfg.hidden_size, "mlp.down": cfg.intermediate_size})
    if cfg.num_experts:
        shapes.update({"mlp.experts.gate_up": cfg.hidden_size, "mlp.experts.down": cfg.moe_intermediate_size})
    if cfg.num_experts and cfg.shared_expert_intermediate_size:
        shapes.update({"mlp.shared_expert.gate_up": cfg.hidden_size,
                       "mlp.shared_expert.down": cfg.shared_expert_intermediate_size})
    return shapes


def quantized_head_source(cfg: ModelConfig, quantization: dict[str, Any] | None) -> str | None:
    """The converted tensor stored as the quantized LM head (`head_linear.qweight`/`.scales`):
    lm_head.weight, or embed_tokens.weight when tied; None when the head is not quantized."""
    if not quantization or not quantization.get("lm_head"):
        return None
    return "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def is_quantized_weight(name: str) -> bool:
    """Whether converted tensor `name` (e.g. layers.3.attn.qkv.weight) is one --quantization stores packed."""
    return layer_path(name) in QUANTIZED_LAYERS and name.endswith(".weight")


def layer_path(name: str) -> str | None:
    """The module path inside its decoder layer of converted tensor `name`, an expert's without its index
    (layers.3.mlp.experts.5.down.weight → mlp.experts.down); None for a tensor outside the layers."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "layers":
        return None
    inner = parts[2:-1]
    if inner[:2] == ["mlp", "experts"] and len(inner) == 4 and inner[2].isdigit():
        del inner[2]
    return ".".join(inner)
