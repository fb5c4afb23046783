"""The one generic decoder, on packed tokens with the paged-KV attention op.

Reads top to bottom like the paper: Attention → MLP (mlp.py) or SparseMoE (moe.py) → DecoderLayer →
CausalLM. Every family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, GPT-2, and the
Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE) is this network with different flags
(ModelConfig); their weights arrive through the tables in `builder/architectures.py`. The switches
beyond the Llama-style decoder, each off by default: partial RoPE (`rotary_dim`), RMSNorm with a
(1 + weight) scale (`norm_weight_offset`), scaled embeddings (`embedding_multiplier`), sandwich norms
(`sandwich_norm`), the attention scale (`attention_scale`), soft-capped attention scores and logits
(`attn_logit_softcapping`, `final_logit_softcapping`) and a second RoPE for sliding-window layers
(`rope_local_*` with `layer_types`).

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
from trtforge.models.mlp import MLP
from trtforge.models.model_config import ModelConfig
from trtforge.models.moe import SparseMoE
from trtforge.models.rope import apply_rotary, rotary_cos_sin
from trtforge.models.tensor_parallel import TPShard, local_config
from trtforge.plugins.cpu import fused as cpu_fused
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.plugins.paged_attention.op import eager_impl


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale (the order matters for bf16 parity).

    offset (Gemma's RMSNorm: 1.0): the scale is (offset + weight), and it is applied in float32
    before the cast back, as transformers' Gemma does; the stored weight is the checkpoint's."""

    def __init__(self, dim: int, eps: float, fused: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        """Try the C loop first (plugins/cpu/fused.py; it takes float32 CPU eager inference only)."""
        self.offset = offset

    def scale(self) -> torch.Tensor:
        """The weight the normalised values are multiplied by: weight, or (offset + weight) in float32."""
        return self.weight if not self.offset else self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.scale()
        fused = cpu_fused.rms_norm(x, weight, self.eps) if self.fused else None  # one C loop
        if fused is not None:
            return fused[0]
        dtype = x.dtype
        if dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)  # same math, one op
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scaled in float32, then cast
            return (h * weight).to(dtype)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's update and the next
        sublayer's input. The fused kernel writes the sum into `residual` in place."""
        fused = cpu_fused.rms_norm(x, self.scale(), self.eps, residual) if self.fused else None
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
        return RMSNorm(dim, cfg.norm_eps, layers.fused_ops, cfg.norm_weight_offset)
    return LayerNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.cfg = cfg
        self.qkv = layers.linear("attn.qkv", cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias)
        self.o_proj = layers.linear("attn.o_proj", cfg.q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim, layers)
            self.k_norm = make_norm(cfg, cfg.head_dim, layers)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5
        self.softcap = cfg.attn_logit_softcapping or 0.0
        """> 0: the op soft-caps the scores (Gemma 2); 0: the op is called exactly as without the option."""
        self.fused_rope = layers.fused_ops and cfg.rope_dim == cfg.head_dim  # the C loop rotates whole heads
        self.window = 0
        """Sliding window of this layer (cfg.layer_window; CausalLM sets it): > 0 the op's `window`; 0: full."""
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
        extra = {"softcap": self.softcap} if self.softcap else {}
        if self.window:
            extra["window"] = self.window
        if kv_scales is None:  # torch.ops.trtforge.paged_attention (or its implementation, in eager mode)
            out = eager_impl(q, False, self.paged_attention)(*args, **extra)  # [T, Hq, D]
        else:  # torch.ops.trtforge.paged_attention_int8kv
            out = eager_impl(q, True, self.paged_attention)(*args, kv_scales, **extra)
        return self.o_proj(out.reshape(t, c.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers, local_rope: bool = False, moe: bool = False):
        super().__init__()
        self.input_norm = make_norm(cfg, cfg.hidden_size, layers)
        self.attn = Attention(cfg, layers)
        self.post_attn_norm = make_norm(cfg, cfg.hidden_size, layers)
        """The MLP's input norm (Gemma's pre_feedforward_layernorm; Llama's post_attention_layernorm)."""
        self.mlp = SparseMoE(cfg, layers) if moe else MLP(cfg, layers)
        """The dense MLP, or (moe: Mixtral, Qwen MoE) the router and its experts (models/moe.py)."""
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Gemma 2/3: the sublayers' outputs are normalised before the residual add
            self.attn_out_norm = make_norm(cfg, cfg.hidden_size, layers)
            self.mlp_out_norm = make_norm(cfg, cfg.hidden_size, layers)
        self.local_rope = local_rope
        """This layer rotates with the sliding layers' RoPE (CausalLM passes both; Gemma 3)."""
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
        if self.sandwich:
            h = self.attn_out_norm(h)
        h, residual = self.post_attn_norm.add_norm(h, residual)
        h = self.mlp(h)
        if self.all_reduce is not None:
            h = self.all_reduce(h)
        if self.sandwich:
            h = self.mlp_out_norm(h)
        return h, residual


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
            self.register_buffer("rope_inv_freq", torch.zeros(cfg.rope_dim // 2), persistent=True)
            if cfg.rope_local_type is not None:  # Gemma 3: the sliding layers' own RoPE
                self.register_buffer("rope_local_inv_freq", torch.zeros(cfg.rope_dim // 2), persistent=True)
        layer_cfg = cfg if shard is None else local_config(cfg, shard)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, layers, cfg.uses_local_rope(i), cfg.is_moe_layer(i))
                                    for i in range(cfg.num_layers))
        for i, layer in enumerate(self.layers):
            layer.attn.window = cfg.layer_window(i)  # sliding-window layers (0: full attention)
        self._embedding_multipliers: dict[torch.dtype, float] = {}
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
        c = self.cfg
        x = self.embed_tokens(input_ids)  # [T, H]
        if c.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden), rounded to the embeddings' dtype first
            x = x * self._embedding_multiplier(x.dtype)
        rope = local_rope = None
        if c.position == "learned":
            x = x + self.pos_embed(positions)
        else:
            rope = rotary_cos_sin(positions, self.rope_inv_freq, c.rope_attention_scaling, x.dtype)
            if c.rope_local_type is not None:
                local_rope = rotary_cos_sin(positions, self.rope_local_inv_freq, c.rope_local_attention_scaling,
                                            x.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, local_rope if layer.local_rope else rope, kv_cache, meta,
                                None if kv_scales is None else kv_scales[i])
        # [S', H]: only rows whose logits are needed
        x, _ = self.final_norm.add_norm(x[logits_indices], residual[logits_indices])
        logits = self.head(x).float()  # [S', V] (this rank's slice of V with a shard)
        if c.final_logit_softcapping:  # Gemma 2: c * tanh(logits / c)
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits if self.gather_vocab is None else self.gather_vocab(logits)

    def _embedding_multiplier(self, dtype: torch.dtype) -> float:
        """cfg.embedding_multiplier rounded to float32 and then to `dtype`, as a Python float: what
        transformers' Gemma multiplies by (its float32 buffer cast to the embedding dtype), with no
        tensor made per call (CUDA graphs capture this)."""
        value = self._embedding_multipliers.get(dtype)
        if value is None:
            value = float(torch.tensor(self.cfg.embedding_multiplier, dtype=torch.float32).to(dtype))
            self._embedding_multipliers[dtype] = value
        return value
