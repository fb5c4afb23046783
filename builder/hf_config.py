"""Reading a Hugging Face config (`transformers.PretrainedConfig`) into a ModelConfig: the
family is found through the weight tables (architectures.py)."""

from __future__ import annotations

from typing import Any

from trtforge.builder.architectures import ArchSpec, spec_for
from trtforge.models.errors import BuildError
from trtforge.models.model_config import ModelConfig

# RoPE variants whose frequencies do not depend on the running sequence length: we can compute
# them once at build time (with transformers' own functions) and bake them into the engine.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def model_config_from_hf(hf: Any) -> ModelConfig:
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
    def g(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

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
