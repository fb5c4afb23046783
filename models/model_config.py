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
    """Weight-table family: llama | mistral | qwen2 | qwen3 | gpt2."""
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
    """Name understood by `network.activation`: silu, gelu, gelu_tanh, relu."""
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
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    """The checkpoint's stored dtype (what `--dtype auto` resolves to)."""

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
