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


def _rope_parameters(hf: Any) -> tuple[dict, dict | None, bool]:
    """(global layers' RoPE parameters, the sliding layers' own or None, whether the config holds
    them per layer type). transformers 5 keeps them in `rope_parameters`, per layer type for Gemma 3
    ({"full_attention": ..., "sliding_attention": ...}); older configs in `rope_scaling` + `rope_theta`
    (+ Gemma 3's `rope_local_base_freq`)."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
        return dict(params.get("full_attention") or {}), params.get("sliding_attention"), True
    params = dict(params or getattr(hf, "rope_scaling", None) or {})
    local = getattr(hf, "rope_local_base_freq", None)
    return params, (None if local is None else {"rope_type": "default", "rope_theta": local}), False


def rope_layer_types(hf: Any) -> tuple[str | None, str | None]:
    """The layer types to pass to transformers' RoPE functions for the global and the sliding layers'
    frequencies: ("full_attention", "sliding_attention") where the config holds RoPE per layer type
    (Gemma 3 under transformers 5), else (None, None)."""
    return ("full_attention", "sliding_attention") if _rope_parameters(hf)[2] else (None, None)


def _rope_type(params: dict) -> str:
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return "longrope" if rope_type == "su" else rope_type  # Phi-3's old name for LongRoPE


def _rope(hf: Any, params: dict, default_theta: float = 10000.0, where: str = "") -> tuple[str, float]:
    rope_type = _rope_type(params)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None) or default_theta)
    if rope_type not in (*STATIC_ROPE_TYPES, "longrope"):
        raise BuildError(
            f"RoPE scaling type {rope_type!r}{where} is not supported (its frequencies change with the "
            f"sequence length). Supported: {', '.join(STATIC_ROPE_TYPES)}, and longrope up to its "
            f"original_max_position_embeddings."
        )
    return rope_type, float(theta)


def _longrope_limit(hf: Any, params: dict) -> int:
    """LongRoPE (Phi-3 `longrope` / `su`): transformers rotates with the short factors while a forward
    pass's positions stay within original_max_position_embeddings and switches the whole pass to the long
    factors past it (re-rotating nothing already cached). trtforge bakes the short factors and caps the
    engine there; the long range is refused by name at build time (build_config.validate)."""
    limit = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", None)
    if not limit:
        raise BuildError("RoPE scaling type 'longrope' without original_max_position_embeddings: the config "
                         "does not say where its short factors end.")
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), (list, tuple)):
            raise BuildError(f"RoPE scaling type 'longrope' needs a {key} list in rope_scaling.")
    return int(limit)


def _rotary_dim(spec: ArchSpec, hf: Any, params: dict, head_dim: int) -> int | None:
    """Features per head that RoPE rotates: None for all of them; Phi-3's partial_rotary_factor."""
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    if factor == 1.0:
        return None
    if spec.family != "phi3":
        raise BuildError(f"partial rotary embeddings (partial_rotary_factor {factor}) are not supported for "
                         f"{spec.architecture}: trtforge rotates partial heads for Phi3ForCausalLM only.")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise BuildError(f"partial_rotary_factor {factor} rotates {dim} of the {head_dim} features per head; "
                         f"RoPE needs an even number of at least 2.")
    return None if dim == head_dim else dim


def _sliding_window(hf: Any) -> int | None:
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return window if any(t != "full_attention" for t in layer_types) else None
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    return window


def _layer_windows(hf: Any, layer_types: list[str] | None) -> list[int] | None:
    """Per layer the sliding window the op applies (0: full attention), as transformers decides it: layer_types'
    "sliding_attention" layers (Gemma 2/3, Qwen2/Qwen3 configs that list them); Qwen2/Qwen3 without layer_types:
    the layers from max_window_layers on, when use_sliding_window; Mistral (no layer_types): every layer.
    None: no layer is windowed."""
    window = _sliding_window(hf)
    if not window:
        return None
    layers = int(hf.num_hidden_layers)
    if layer_types is not None:
        windows = [int(window) if t == "sliding_attention" else 0 for t in layer_types]
    elif getattr(hf, "max_window_layers", None) is not None and getattr(hf, "use_sliding_window", None) is not None:
        windows = [int(window) if i >= int(hf.max_window_layers) else 0 for i in range(layers)]
    else:
        windows = [int(window)] * layers
    return windows if any(windows) else None


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
    params, local_params, _ = _rope_parameters(hf)
    rope_type, theta = _rope(hf, params, 1_000_000.0 if spec.family == "gemma3" else 10000.0)
    attention_bias = bool(g("attention_bias", False))
    hidden_act = g("hidden_activation") or g("hidden_act")  # Gemma names it hidden_activation
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}.get(hidden_act, hidden_act)
    extra = _gemma_switches(spec, hf, local_params) if spec.family in ("gemma2", "gemma3") else {}
    if spec.family in MOE_FAMILIES:
        extra.update(_moe_switches(spec, hf))
        attention_bias = attention_bias or bool(g("qkv_bias", False))  # Qwen2-MoE names its q/k/v bias qkv_bias
    rotary_dim = _rotary_dim(spec, hf, params, head_dim)
    if rope_type == "longrope":
        extra["rope_max_seq_len"] = _longrope_limit(hf, params)
    return ModelConfig(
        architecture=spec.architecture, family=spec.family, vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size), num_layers=int(hf.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(g("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size), norm="rms", norm_eps=float(hf.rms_norm_eps),
        activation=act, gated_mlp=True, position="rope",
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        qkv_bias=spec.qkv_bias or attention_bias,
        o_bias=attention_bias and spec.family in ("llama", "qwen3", "gemma2", "gemma3", "qwen3_moe"),
        mlp_bias=bool(g("mlp_bias", False)), qk_norm=spec.qk_norm, rope_type=rope_type,
        rope_theta=theta, sliding_window=_sliding_window(hf), rotary_dim=rotary_dim,
        layer_windows=_layer_windows(hf, extra.get("layer_types", g("layer_types"))),
        bos_token_id=g("bos_token_id"), eos_token_ids=_eos_list(g("eos_token_id")), pad_token_id=g("pad_token_id"),
        torch_dtype=_dtype_name(hf), **extra,
    )


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _moe_switches(spec: ArchSpec, hf: Any) -> dict[str, Any]:
    """The Mixture-of-Experts fields of ModelConfig (models/moe.py), or BuildError for what trtforge does not run.
    Mixtral: every layer sparse, experts of intermediate_size, top-k always renormalised. Qwen2/3-MoE: experts
    of moe_intermediate_size, norm_topk_prob, dense layers where mlp_only_layers / decoder_sparse_step say
    (as transformers' decoder layers decide), Qwen2-MoE's shared expert."""
    def g(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    layers = int(hf.num_hidden_layers)
    if spec.family == "mixtral":
        experts, width, normalize, shared, sparse = int(hf.num_local_experts), int(hf.intermediate_size), True, 0, None
    else:
        experts, width = int(g("num_experts") or 0), int(hf.moe_intermediate_size)
        normalize = bool(g("norm_topk_prob", False))
        shared = int(g("shared_expert_intermediate_size") or 0) if spec.family == "qwen2_moe" else 0
        step, dense = int(g("decoder_sparse_step") or 1), set(g("mlp_only_layers") or [])
        sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    k = int(hf.num_experts_per_tok)
    if experts and not 1 <= k <= experts:
        raise BuildError(f"{spec.architecture}: num_experts_per_tok {k} must be between 1 and the {experts} "
                         f"experts.")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=normalize,
                shared_expert_intermediate_size=shared, moe_layers=sparse)


def _gemma_switches(spec: ArchSpec, hf: Any, local_params: dict | None) -> dict[str, Any]:
    """The ModelConfig switches of Gemma 2 / Gemma 3 (text), or BuildError for what trtforge does not run."""
    def g(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    if g("use_bidirectional_attention"):
        raise BuildError(f"{spec.architecture} with use_bidirectional_attention is not supported: trtforge's "
                         f"attention is causal.")
    attn_cap = g("attn_logit_softcapping")
    if spec.family == "gemma3" and attn_cap is not None:
        raise BuildError(f"{spec.architecture} with attn_logit_softcapping {attn_cap} is refused: transformers' "
                         f"Gemma 3 does not apply it (only Gemma 2 soft-caps attention scores), so there is no "
                         f"reference to match. Set it to null.")
    layer_types = g("layer_types")
    pattern = g("sliding_window_pattern")
    if layer_types is None and pattern:  # configs before layer_types: every pattern-th layer is global
        layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                       for i in range(int(hf.num_hidden_layers))]
    layer_types = None if layer_types is None else [str(t) for t in layer_types]
    if layer_types is not None and set(layer_types) - {"full_attention", "sliding_attention"}:
        raise BuildError(f"{spec.architecture}: layer_types {sorted(set(layer_types))} are not all "
                         f"full_attention / sliding_attention.")
    switches: dict[str, Any] = dict(
        norm_weight_offset=1.0, embedding_multiplier=float(hf.hidden_size) ** 0.5, sandwich_norm=True,
        attention_scale=float(g("query_pre_attn_scalar") or hf.head_dim) ** -0.5,
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=None if g("final_logit_softcapping") is None else float(hf.final_logit_softcapping),
        layer_types=layer_types)
    if spec.family == "gemma3" and local_params is not None and layer_types and "sliding_attention" in layer_types:
        local_type, local_theta = _rope(hf, local_params, 10000.0, " (sliding layers)")
        if local_type == "longrope":
            raise BuildError(f"{spec.architecture}: longrope on the sliding layers is not supported.")
        switches.update(rope_local_type=local_type, rope_local_theta=local_theta)
    return switches


def _dtype_name(hf: Any) -> str | None:
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dt is None:
        return None
    return str(dt).replace("torch.", "")
