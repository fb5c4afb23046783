"""How the network's layers are built: the kernels registry's choice (plugins/kernels.py) made layers.

`CausalLM` (network.py) constructs every linear layer, its LM head, its token embeddings, the fused
ops of its norms / RoPE / MLP and its attention through one `Layers`, so which kernel a layer runs
is fixed when the network is built; after loading, `pack_weights` only rewrites the CPU kernels'
weights into their packed layout (and a packed tied head then serves the embeddings):

    Layers()                      plain torch: nn.Linear, an F.linear head, the op's attention
                                  resolved per call — what conversion, export and tracing see
    Layers.for_engine(cfg, device, "auto")   the runtime's layers (`load_network(..., kernels="auto")`):
                                  `kernels.choose(device, dtype)` consulted here and nowhere else,
                                  with the engine's quantization

What a choice builds (the kernels beside each reference: plugins/cpu/*.py):

    linear "cpu"      CpuLinear (packed C GEMM / oneDNN) for every float linear; the LM head `cpu_linear`
    linear "torch"    nn.Linear; the LM head F.linear
    quantization      QuantLinear for the decoder's QUANTIZED_LAYERS and, when engine.json says so,
                      the LM head (`head_linear`, a tied one also the embeddings: QuantEmbedding);
                      its C kernels and activation rounding as `quant_linear` / `quant_activations` say
    fused_ops "cpu"   RMSNorm, RoPE and SiLU·mul try their C loops first (plugins/cpu/fused.py)
    attention         the implementation resolved for the device (plugins/paged_attention/op.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from trtforge.models.dtypes import torch_dtype
from trtforge.models.model_config import ModelConfig
from trtforge.models.quantized_layers import QUANTIZED_LAYERS, QuantEmbedding, QuantLinear
from trtforge.plugins import kernels as registry
from trtforge.plugins.cpu import linear as cpu_linear_kernels
from trtforge.plugins.cpu.linear import CpuLinear, cpu_linear
from trtforge.plugins.paged_attention.op import AttentionImpl, attention_impl

KERNEL_MODES = ("reference", "auto")


class TiedLMHead(nn.Module):
    """The LM head of tied embeddings: logits = x E^T over the embedding table (this rank's rows of
    it with a tensor-parallel shard). Until `pack_weights` it holds no tensor of its own (the loaded
    table is read at each call); after it, the packed rows, and the whole-vocabulary table itself is
    dropped (the embeddings are then read from the packed rows: models/layers.py pack_weights)."""

    def __init__(self, embedding: nn.Embedding, vocab: tuple[int, int] | None,
                 kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]):
        super().__init__()
        self._embedding = (embedding,)  # a tuple: not a submodule, so the state dict names the table once
        self.vocab = vocab
        self.kernel = kernel
        """F.linear, or plugins/cpu/linear.cpu_linear (oneDNN on the dense table; once packed, the
        packed C GEMM runs instead, and the CPU decode plan calls it on `packed` itself)."""

    @property
    def weight(self) -> torch.Tensor:
        table = self._embedding[0].weight
        if table is None:  # packed, the table dropped (pack_weights): unpacked, a copy
            return cpu_linear_kernels.unpack(self.packed, self.out_features)
        return table if self.vocab is None else table[self.vocab[0]:self.vocab[1]]  # rows: a contiguous view

    @property
    def in_features(self) -> int:
        return self._embedding[0].embedding_dim

    @property
    def out_features(self) -> int:
        return self._embedding[0].num_embeddings if self.vocab is None else self.vocab[1] - self.vocab[0]

    def extra_repr(self) -> str:
        return f"tied to the embeddings, kernel={getattr(self.kernel, '__name__', self.kernel)}"

    packed: torch.Tensor | None = None
    """The table's rows packed for plugins/cpu/linear.c (`pack_weights`), else None."""

    def pack_weights(self) -> None:
        """Pack the table (this rank's rows) for the C kernel when this head runs `cpu_linear`."""
        if self.kernel is cpu_linear and self.packed is None and cpu_linear_kernels.library() is not None:
            self.packed = cpu_linear_kernels.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and cpu_linear_kernels.packed_ok(x):
            return cpu_linear_kernels.packed_linear(x, self.packed, None, self.out_features)
        return self.kernel(x, self.weight, None)


def pack_weights(network: nn.Module) -> None:
    """At load (models/loader.py): every CpuLinear and a `cpu_linear` TiedLMHead pack their weights
    for plugins/cpu/linear.c, int8 QuantLinears theirs for the VNNI kernel where the CPU has it. A
    packed tied head of the whole vocabulary then also serves the embeddings (PackedEmbedding reads
    the table's rows from it) and the dense table is dropped, so the model holds it once."""
    for module in network.modules():
        if isinstance(module, (CpuLinear, TiedLMHead, QuantLinear)):
            module.pack_weights()
    head = getattr(network, "lm_head", None)
    if isinstance(head, TiedLMHead) and head.packed is not None and head.vocab is None \
            and network.embed_tokens is head._embedding[0]:
        network.embed_tokens = cpu_linear_kernels.PackedEmbedding(head)
        head._embedding[0].weight = None


@dataclass(frozen=True)
class Layers:
    """The layer factory a CausalLM is built with (module docstring)."""

    kernels: registry.Kernels = registry.REFERENCE
    quantization: Mapping[str, Any] | None = None
    """engine.json's `quantization` (scheme, group_size, lm_head, lm_head_group_size), or None."""
    dtype: torch.dtype = torch.float32
    """The engine's dtype: what a quantized tied embedding returns."""
    attention: AttentionImpl | None = None
    """The attention implementation every layer calls in eager mode; None: the op's per-call choice."""

    @classmethod
    def for_engine(cls, cfg: Any, device: str | torch.device, kernels: str = "reference") -> "Layers":
        """The layers of an engine (an EngineConfig): kernels "reference" (plain torch, for export
        and conversion) or "auto" (the registry's choice for `device` and the engine's dtype)."""
        dtype = torch_dtype(cfg.dtype)
        quantization = cfg.quantization or None
        if kernels == "reference":
            return cls(registry.REFERENCE, quantization, dtype)
        if kernels != "auto":
            raise ValueError(f"kernels={kernels!r}: choose one of {KERNEL_MODES}")
        device = torch.device(device)
        choice = registry.choose(device, dtype)
        softcap = bool(getattr(cfg.model, "attn_logit_softcapping", None))  # Triton has none: the torch path
        return cls(choice, quantization, dtype, attention_impl(choice.attention, device, softcap))

    @property
    def fused_ops(self) -> bool:
        """Whether norms, RoPE and SiLU·mul try the C loops of plugins/cpu/fused.py first."""
        return self.kernels.fused_ops == "cpu"

    def linear(self, path: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """The linear layer at `path` inside a decoder layer (e.g. "attn.qkv", QUANTIZED_LAYERS)."""
        q = self.quantization
        if q and path in QUANTIZED_LAYERS:
            return QuantLinear(in_features, out_features, bias, q["scheme"], int(q.get("group_size") or 0),
                               kernels=self.kernels)
        if self.kernels.linear == "cpu":
            return CpuLinear.empty(in_features, out_features, bias)
        return nn.Linear(in_features, out_features, bias=bias)

    def quantized_head(self, cfg: ModelConfig) -> QuantLinear | None:
        """The quantized LM head where engine.json asks for one (quantization["lm_head"]; absent in
        engines built before it), else None. It never dequantises itself whole (`gemv_only`)."""
        q = self.quantization
        if not q or not q.get("lm_head"):
            return None
        head = QuantLinear(cfg.hidden_size, cfg.vocab_size, False, q["lm_head"], int(q.get("lm_head_group_size") or 0),
                           kernels=self.kernels)
        head.gemv_only = True
        return head

    def embedding(self, cfg: ModelConfig, quantized_head: QuantLinear | None) -> nn.Module:
        """The token embeddings: a table of their own, or a quantized tied head's rows (QuantEmbedding)."""
        if quantized_head is not None and cfg.tie_word_embeddings:
            return QuantEmbedding(quantized_head, self.dtype)
        return nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def tied_head(self, embedding: nn.Embedding, vocab: tuple[int, int] | None) -> TiedLMHead:
        return TiedLMHead(embedding, vocab, cpu_linear if self.kernels.linear == "cpu" else F.linear)

    def describe(self) -> str:
        return self.kernels.describe(None if self.attention is None else self.attention.name)


__all__ = ["KERNEL_MODES", "Layers", "TiedLMHead", "pack_weights"]
