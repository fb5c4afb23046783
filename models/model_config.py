"""What the model *is*: the architecture facts of a checkpoint.

Read once from `transformers.AutoConfig` at the edge (build time: builder/hf_config.py), stored in
engine.json, and passed whole to the network. Nothing here depends on how the engine is built or scheduled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Architecture and dimensions of a decoder-only LM (one generic decoder covers all families)."""

    architecture: str
    """Hugging Face class name, e.g. `Qwen2ForCausalLM`."""
    family: str
    """Weight-table family: llama | mistral | qwen2 | qwen3 | phi3 | gemma2 | gemma3 | gpt2 | mixtral | qwen2_moe |
    qwen3_moe."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads (Hq)."""
    num_kv_heads: int
    """Key/value heads (Hkv); Hq % Hkv == 0. Hkv == 1 is MQA, 1 < Hkv < Hq is GQA."""
    head_dim: int
    """D; not always hidden_size / num_heads (Qwen3)."""
    intermediate_size: int
    norm: str
    """"rms" (RMSNorm) or "layer" (LayerNorm with bias)."""
    norm_eps: float
    activation: str
    """Name understood by `network.activation`: silu, gelu, gelu_tanh (GeGLU with gated_mlp: Gemma), relu."""
    gated_mlp: bool
    """SwiGLU-style `down(act(gate(x)) * up(x))` (True) or `down(act(up(x)))` (GPT-2)."""
    position: str
    """"rope" or "learned" (absolute position embeddings, GPT-2)."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    rope_type: str = "default"
    rope_theta: float = 10000.0
    rope_attention_scaling: float = 1.0
    """Multiplier of cos/sin (YaRN's mscale); 1.0 for the other RoPE types."""
    sliding_window: int | None = None
    """The smallest attention window of the model's sliding layers (None: all full attention). With
    `layer_windows` set the network honours each layer's window (the op's `window`) and the torch build no longer
    caps max_seq_len at it; without (engines built before), and for backends that cannot honour windows
    (tensorrt, trtllm), the build caps max_seq_len at it, so every layer attends to its whole context (exactly what a
    sliding-window layer does for sequences no longer than its window)."""
    layer_windows: list[int] | None = None
    """Per layer, the attention window the paged-KV op applies (a token at p sees (p - window, p], transformers'
    rule); 0: full attention. Mistral: every layer; Qwen2/Qwen3 with use_sliding_window: layers >= max_window_layers
    (or as layer_types says); Gemma 2/3: the "sliding_attention" layers. None: no layer windowed (engines built
    before this field load with that meaning, their max_seq_len capped at sliding_window)."""
    # ---- switches beyond the Llama-style decoder (defaults: off; engines built before them load as they were) ----
    rotary_dim: int | None = None
    """RoPE rotates only the first rotary_dim features of each head, the rest pass through (Phi-3's
    partial_rotary_factor); None: all of head_dim."""
    rope_max_seq_len: int | None = None
    """Longest sequence the baked RoPE frequencies are exact for (longrope: original_max_position_embeddings, past
    which transformers switches to the long factors, which trtforge does not); the build caps max_seq_len at it."""
    norm_weight_offset: float = 0.0
    """RMSNorm scales by (offset + weight), computed in float32 (Gemma: 1.0; weights stored as in the checkpoint)."""
    embedding_multiplier: float = 1.0
    """Token embeddings are multiplied by this (Gemma: sqrt(hidden_size)), rounded to the embedding dtype first as
    transformers does."""
    sandwich_norm: bool = False
    """Gemma 2/3: RMSNorm on the attention output and on the MLP output too (post_attention_layernorm,
    post_feedforward_layernorm) before each is added to the residual; `post_attn_norm` is then the pre-MLP
    norm (pre_feedforward_layernorm)."""
    attention_scale: float | None = None
    """Softmax scale of the attention scores (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores s become c * tanh(s / c) before the softmax (Gemma 2); None: not capped."""
    final_logit_softcapping: float | None = None
    """Logits l become c * tanh(l / c) (Gemma 2, Gemma 3 where set); None: not capped."""
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention" (Gemma 2/3), as the checkpoint's config says; decides
    which RoPE a layer uses (`rope_local_*`). None: every layer full attention."""
    rope_local_type: str | None = None
    """RoPE of the sliding-attention layers when it differs from the global layers' (Gemma 3: rope_local_base_freq,
    stored as the tensor `rope_local_inv_freq`); None: every layer uses rope_type / rope_theta."""
    rope_local_theta: float | None = None
    rope_local_attention_scaling: float = 1.0
    # ---- Mixture-of-Experts (models/moe.py; num_experts 0: every layer has the dense MLP) ----
    num_experts: int = 0
    """Routed experts of each MoE layer (Mixtral: num_local_experts, Qwen MoE: num_experts); 0: a dense model."""
    num_experts_per_tok: int = 0
    """k of the router's top-k: experts each token is sent to."""
    moe_intermediate_size: int = 0
    """Intermediate width of one routed expert (Mixtral: intermediate_size; Qwen MoE: moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalise the k selected softmax probabilities to sum to 1 (Mixtral always; Qwen MoE: norm_topk_prob)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (a dense gated MLP every token runs, scaled by sigmoid(shared_expert_gate(x)));
    0: none."""
    moe_layers: list[int] | None = None
    """Indices of the layers with an MoE block (Qwen MoE's decoder_sparse_step / mlp_only_layers leave dense
    layers, which use intermediate_size); None: every layer, when num_experts > 0."""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    """The checkpoint's stored dtype (what `--dtype auto` resolves to)."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs the MoE block (models/moe.py) instead of the dense MLP."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def rope_dim(self) -> int:
        """Features of each head that RoPE rotates (rotary_dim, else head_dim)."""
        return self.rotary_dim or self.head_dim

    def layer_window(self, layer: int) -> int:
        """The attention window of layer `layer` (0: full attention)."""
        return 0 if self.layer_windows is None else int(self.layer_windows[layer])

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer attends within a window (Mistral-style): KV blocks before the largest window can be freed."""
        return bool(self.layer_windows) and all(w > 0 for w in self.layer_windows)

    @property
    def kv_window(self) -> int:
        """The window past which no layer reads KV: the largest layer window when every layer is windowed, else 0
        (some layer attends to the whole context, so every block is kept). What the scheduler frees blocks by."""
        return max(self.layer_windows) if self.all_layers_windowed else 0

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the sliding layers' own RoPE (`rope_local_inv_freq`)."""
        return (self.rope_local_type is not None and self.layer_types is not None
                and self.layer_types[layer] == "sliding_attention")

    def switches_beyond_llama(self) -> list[str]:
        """The switches above in use (names): what a Llama-style fast path (the CPU decode plan) must not skip."""
        used = {"rotary_dim": self.rotary_dim not in (None, self.head_dim),
                "norm_weight_offset": self.norm_weight_offset, "embedding_multiplier": self.embedding_multiplier != 1.0,
                "sandwich_norm": self.sandwich_norm, "attention_scale": self.attention_scale is not None,
                "attn_logit_softcapping": self.attn_logit_softcapping,
                "final_logit_softcapping": self.final_logit_softcapping,
                "rope_local_type": self.rope_local_type is not None, "num_experts": self.num_experts > 0}
        return [name for name, on in used.items() if on]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)
