"""The one generic decoder, on packed tokens with the paged-KV attention op.

Reads top to bottom like the paper: Attention → MLP → DecoderLayer → CausalLM. Every family
(Llama, Mistral, Qwen2, Qwen3, GPT-2) is this network with different flags (ModelConfig);
their weights arrive through the tables in `architectures.py`.

There is no batch dimension and no padding: an iteration's T new tokens from S sequences
(prompt chunks and decode tokens mixed) are one [T, hidden] matrix, and `AttentionMetadata`
tells the attention op which cache blocks each sequence owns.

Which kernels the layers run is fixed when the network is built, by the `Layers` it is given
(layers.py: plain torch by default; the loader passes the kernels registry's choice for the
runtime). Every fast path sits beside the torch code it replaces: the C loops of
plugins/cpu/fused.py run where `Layers.fused_ops` says so and the tensors allow, the torch lines
after them otherwise (and always while tracing or exporting).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trtforge.plugins.paged_attention  # noqa: F401  (registers torch.ops.trtforge.paged_attention)
from trtforge.models.layers import Layers
from trtforge.models.model_config import ModelConfig
from trtforge.models.rope import apply_rotary, rotary_cos_sin
from trtforge.models.tensor_parallel import TPShard, local_config
from trtforge.plugins.cpu import fused as cpu_fused
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.plugins.paged_attention.op import eager_impl

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale (the order matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        """Try the C loop first (plugins/cpu/fused.py; it takes float32 CPU eager inference only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_fused.rms_norm(x, self.weight, self.eps) if self.fused else None  # one C loop
        if fused is not None:
            return fused[0]
        dtype = x.dtype
        if dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # same math, one op
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's update and the next
        sublayer's input. The fused kernel writes the sum into `residual` in place."""
        fused = cpu_fused.rms_norm(x, self.weight, self.eps, residual) if self.fused else None
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
        return self(x), x


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with RMSNorm's residual interface (GPT-2)."""

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self(x), x


def make_norm(cfg: ModelConfig, dim: int, layers: Layers) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(dim, cfg.norm_eps, layers.fused_ops)
    return LayerNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.cfg = cfg
        self.qkv = layers.linear("attn.qkv", cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias)
        self.o_proj = layers.linear("attn.o_proj", cfg.q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, layers.fused_ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, layers.fused_ops)
        self.scale = cfg.head_dim ** -0.5
        self.fused_rope = layers.fused_ops
        self.paged_attention = layers.attention
        """The implementation eager calls run (plugins/paged_attention/op.py); None: the op's per-call choice."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """kv_scales: int8 KV (--kv-cache-dtype int8): kv_cache is int8 and these its scales."""
        c = self.cfg
        t, hq, hkv = x.shape[0], c.num_heads, c.num_kv_heads
        qkv = self.qkv(x).view(t, hq + 2 * hkv, c.head_dim)  # heads of q, then k, then v
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        elif rope is not None and not (self.fused_rope and cpu_fused.rope_heads_(qkv, *rope, hq + hkv)):  # C, in place
            qk = apply_rotary(qkv[:, :hq + hkv], *rope)  # q and k heads rotated in one pass
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        args = (q, k.contiguous(), v.contiguous(), kv_cache, meta.slot_mapping, meta.block_tables,
                meta.seq_lens, meta.query_start_loc, self.scale)
        if kv_scales is None:  # torch.ops.trtforge.paged_attention (or its implementation, in eager mode)
            out = eager_impl(q, False, self.paged_attention)(*args)  # [T, Hq, D]
        else:  # torch.ops.trtforge.paged_attention_int8kv
            out = eager_impl(q, True, self.paged_attention)(*args, kv_scales)
        return self.o_proj(out.reshape(t, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.gated = cfg.gated_mlp
        self.act = ACTIVATIONS[cfg.activation]
        if self.gated:
            self.gate_up = layers.linear("mlp.gate_up", cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        else:
            self.up = layers.linear("mlp.up", cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.down = layers.linear("mlp.down", cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.fused_silu = layers.fused_ops and self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate_up = self.gate_up(x)  # [T, 2I]
            h = cpu_fused.silu_mul(gate_up) if self.fused_silu else None  # one C loop
            if h is None:
                gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
                h = self.act(gate) * up
            return self.down(h)
        return self.down(self.act(self.up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.input_norm = make_norm(cfg, cfg.hidden_size, layers)
        self.attn = Attention(cfg, layers)
        self.post_attn_norm = make_norm(cfg, cfg.hidden_size, layers)
        self.mlp = MLP(cfg, layers)
        self.all_reduce = None
        """Tensor parallelism: sums the row-parallel o_proj's and down's partial outputs over the ranks."""

    def forward(self, x, residual, rope, kv_cache, meta, kv_scales=None):
        """x: the previous layer's MLP output (the embeddings for layer 0, with residual None);
        returns this layer's MLP output and the residual stream before it. Keeping the residual
        sum apart lets each add be fused into the norm that follows it (vLLM's fused_add_rms_norm)."""
        h, residual = self.input_norm.add_norm(x, residual)
        h = self.attn(h, rope, kv_cache, meta, kv_scales)
        if self.all_reduce is not None:
            h = self.all_reduce(h)
        h, residual = self.post_attn_norm.add_norm(h, residual)
        h = self.mlp(h)
        return (h if self.all_reduce is None else self.all_reduce(h)), residual


class CausalLM(nn.Module):
    """Embeddings → N decoder layers → final norm → LM head, for one packed batch of tokens.

    With `shard` (tensor parallelism, tensor_parallel.py) it is one rank's part: its heads and MLP
    slice in every layer, the LM head of its vocabulary slice; `attach_collectives` gives it the
    all-reduce and the logits' all-gather.

    `layers` builds its linear layers, LM head, embeddings, fused ops and attention (layers.py);
    by default plain torch. The LM head is stored under the name its weights have in the engine:
    `lm_head` (its own float weight, or tied: the embedding table read at each call) or `head_linear`
    (quantized); `head` is whichever the network has."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, layers: Layers | None = None):
        super().__init__()
        layers = layers or Layers()
        self.cfg = cfg
        self.shard = shard
        self.built_with = layers
        """The layer factory this network was built with (its kernels, for the startup log)."""
        self.gather_vocab = None
        quantized_head = layers.quantized_head(cfg)
        self.embed_tokens = layers.embedding(cfg, quantized_head)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.register_buffer("rope_inv_freq", torch.zeros(cfg.head_dim // 2), persistent=True)
        layer_cfg = cfg if shard is None else local_config(cfg, shard)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, layers) for _ in range(cfg.num_layers))
        self.final_norm = make_norm(cfg, cfg.hidden_size, layers)
        if quantized_head is not None:
            self.head_linear = quantized_head
        elif cfg.tie_word_embeddings:
            self.lm_head = layers.tied_head(self.embed_tokens, None if shard is None else shard.vocab)
        else:
            vocab = cfg.vocab_size if shard is None else shard.vocab_size
            self.lm_head = layers.linear("lm_head", cfg.hidden_size, vocab, False)

    @property
    def head(self) -> nn.Module:
        """The module computing the logits: the quantized `head_linear`, else `lm_head`."""
        modules = self._modules
        return modules["head_linear"] if "head_linear" in modules else modules["lm_head"]

    def attach_collectives(self, all_reduce, gather_vocab) -> None:
        """Tensor parallelism: `all_reduce(t)` sums t over the ranks (returns the sum);
        `gather_vocab(logits)` turns this rank's [S', V/tp] logits into the whole [S', V]."""
        for layer in self.layers:
            layer.all_reduce = all_reduce
        self.gather_vocab = gather_vocab

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                logits_indices: torch.Tensor, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids/positions int64 [T]; returns float32 logits [len(logits_indices), V].
        kv_scales: per layer, the scales of its int8 KV pool (--kv-cache-dtype int8), else None."""
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = None
        if self.cfg.position == "learned":
            x = x + self.pos_embed(positions)
        else:
            rope = rotary_cos_sin(positions, self.rope_inv_freq, self.cfg.rope_attention_scaling,
                                  x.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, rope, kv_cache, meta, None if kv_scales is None else kv_scales[i])
        # [S', H]: only rows whose logits are needed
        x, _ = self.final_norm.add_norm(x[logits_indices], residual[logits_indices])
        logits = self.head(x).float()  # [S', V] (this rank's slice of V with a shard)
        return logits if self.gather_vocab is None else self.gather_vocab(logits)
