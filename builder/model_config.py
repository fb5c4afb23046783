"""What the model *is*: the architecture facts read from a Hugging Face config.

Built once from `transformers.AutoConfig` at the edge (build time), stored in engine.json, and
passed whole to the network. Nothing here depends on how the engine is built or scheduled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .architectures import ArchSpec, spec_for
from .errors import BuildError

# RoPE variants whose frequencies do not depend on the running sequence length: we can compute
# them once at build time (with transformers' own functions) and bake them into the engine.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


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

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Read a `transformers.PretrainedConfig` (any supported family)."""
        archs = list(getattr(hf, "architectures", None) or [])
        spec = spec_for(archs, getattr(hf, "model_type", None))
        return _from_hf(spec, hf)


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _rope(hf: Any) -> tuple[str, float]:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope_type not in STATIC_ROPE_TYPES:
        raise BuildError(
            f"RoPE scaling type {rope_type!r} is not supported (its frequencies change with the "
            f"sequence length). Supported: {', '.join(STATIC_ROPE_TYPES)}."
        )
    return rope_type, float(theta)


def _sliding_window(hf: Any) -> int | None:
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return window if any(t != "full_attention" for t in layer_types) else None
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    return window


def _from_hf(spec: ArchSpec, hf: Any) -> ModelConfig:
    g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    if spec.family == "gpt2":
        if g("scale_attn_by_inverse_layer_idx") or g("reorder_and_upcast_attn"):
            raise BuildError("GPT-2 variants with scale_attn_by_inverse_layer_idx / "
                             "reorder_and_upcast_attn are not supported.")
        hidden, heads = int(hf.n_embd), int(hf.n_head)
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(
            hf.activation_function, hf.activation_function)
        return ModelConfig(
            architecture=spec.architecture, family="gpt2", vocab_size=int(hf.vocab_size),
            hidden_size=hidden, num_layers=int(hf.n_layer), num_heads=heads, num_kv_heads=heads,
            head_dim=hidden // heads, intermediate_size=int(g("n_inner") or 4 * hidden),
            norm="layer", norm_eps=float(hf.layer_norm_epsilon), activation=act,
            gated_mlp=False, position="learned", max_position_embeddings=int(hf.n_positions),
            tie_word_embeddings=bool(g("tie_word_embeddings", True)), qkv_bias=True, o_bias=True,
            mlp_bias=True, qk_norm=False, rope_type="none", rope_theta=0.0,
            bos_token_id=g("bos_token_id"), eos_token_ids=_eos_list(g("eos_token_id")),
            pad_token_id=g("pad_token_id"), torch_dtype=_dtype_name(hf),
        )
    heads = int(hf.num_attention_heads)
    head_dim = int(g("head_dim") or hf.hidden_size // heads)
    rope_type, theta = _rope(hf)
    attention_bias = bool(g("attention_bias", False))
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}.get(hf.hidden_act, hf.hidden_act)
    return ModelConfig(
        architecture=spec.architecture, family=spec.family, vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size), num_layers=int(hf.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(g("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size), norm="rms", norm_eps=float(hf.rms_norm_eps),
        activation=act, gated_mlp=True, position="rope",
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        qkv_bias=spec.qkv_bias or attention_bias, o_bias=attention_bias and spec.family in ("llama", "qwen3"),
        mlp_bias=bool(g("mlp_bias", False)), qk_norm=spec.qk_norm, rope_type=rope_type,
        rope_theta=theta, sliding_window=_sliding_window(hf), bos_token_id=g("bos_token_id"),
        eos_token_ids=_eos_list(g("eos_token_id")), pad_token_id=g("pad_token_id"),
        torch_dtype=_dtype_name(hf),
    )


def _dtype_name(hf: Any) -> str | None:
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dt is None:
        return None
    return str(dt).replace("torch.", "")
