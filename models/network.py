"""The one generic decoder, on packed tokens with the paged-KV attention op.

Reads top to bottom like the paper: Attention → MLP → DecoderLayer → CausalLM. Every family
(Llama, Mistral, Qwen2, Qwen3, GPT-2) is this network with different flags (ModelConfig);
their weights arrive through the tables in `architectures.py`.

There is no batch dimension and no padding: an iteration's T new tokens from S sequences
(prompt chunks and decode tokens mixed) are one [T, hidden] matrix, and `AttentionMetadata`
tells the attention op which cache blocks each sequence owns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trtforge.plugins.paged_attention  # noqa: F401  (registers torch.ops.trtforge.paged_attention)
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.plugins.paged_attention.op import eager_impl

from trtforge.plugins.cpu import fused as cpu_fused
from trtforge.models.model_config import ModelConfig
from trtforge.models.rope import apply_rotary, rotary_cos_sin
from trtforge.models.tensor_parallel import TPShard, local_config

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale (the order matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_fused.rms_norm(x, self.weight, self.eps)  # float32 CPU inference: one C loop
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
        fused = cpu_fused.rms_norm(x, self.weight, self.eps, residual)
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


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(dim, cfg.norm_eps)
    return LayerNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.scale = cfg.head_dim ** -0.5

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
        elif rope is not None and not cpu_fused.rope_heads_(qkv, *rope, hq + hkv):  # float32 CPU: in place
            qk = apply_rotary(qkv[:, :hq + hkv], *rope)  # q and k heads rotated in one pass
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        args = (q, k.contiguous(), v.contiguous(), kv_cache, meta.slot_mapping, meta.block_tables,
                meta.seq_lens, meta.query_start_loc, self.scale)
        if kv_scales is None:  # torch.ops.trtforge.paged_attention (or its implementation, in eager mode)
            out = eager_impl(q)(*args)  # [T, Hq, D]
        else:  # torch.ops.trtforge.paged_attention_int8kv
            out = eager_impl(q, int8_kv=True)(*args, kv_scales)
        return self.o_proj(out.reshape(t, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.gated_mlp
        self.act = ACTIVATIONS[cfg.activation]
        if self.gated:
            self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        else:
            self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate_up = self.gate_up(x)  # [T, 2I]
            h = cpu_fused.silu_mul(gate_up) if self.act is F.silu else None  # float32 CPU: one C loop
            if h is None:
                gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
                h = self.act(gate) * up
            return self.down(h)
        return self.down(self.act(self.up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = make_norm(cfg, cfg.hidden_size)
        self.attn = Attention(cfg)
        self.post_attn_norm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
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
    all-reduce and the logits' all-gather."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.gather_vocab = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.register_buffer("rope_inv_freq", torch.zeros(cfg.head_dim // 2), persistent=True)
        layer_cfg = cfg if shard is None else local_config(cfg, shard)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg) for _ in range(cfg.num_layers))
        self.final_norm = make_norm(cfg, cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            vocab = cfg.vocab_size if shard is None else shard.vocab_size
            self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.head_linear: nn.Module | None = None
        """Set by plugins/cpu/linear.py: the LM head as a CPU linear (C GEMV / oneDNN)."""

    def lm_head_weight(self) -> torch.Tensor:
        if not self.cfg.tie_word_embeddings:
            return self.lm_head.weight
        if self.shard is None:
            return self.embed_tokens.weight
        return self.embed_tokens.weight[self.shard.vocab[0]:self.shard.vocab[1]]  # rows: a contiguous view

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
        if self.head_linear is not None:
            logits = self.head_linear(x).float()  # [S', V] (this rank's slice of V with a shard)
        else:
            logits = F.linear(x, self.lm_head_weight()).float()
        return logits if self.gather_vocab is None else self.gather_vocab(logits)
