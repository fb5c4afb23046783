"""Weight tables: how each Hugging Face family's tensors map onto trtforge's one generic decoder.

A new architecture is a new table and a few flags, not a new model file (the flags: ModelConfig,
read from the HF config in hf_config.py). Each rule
names our tensor, the HF tensors it is made from (`{i}` = layer index) and how they combine:

    concat   rows of several HF Linear weights stacked (fused q|k|v, fused gate|up)
    copy     the tensor as it is
    conv1d   GPT-2's Conv1D stores weights as [in, out]; we store nn.Linear's [out, in]

Mixture-of-Experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE: models/moe.py) add `{e}` = expert index, a rule
repeated for every routed expert, and rules that exist only in the MoE layers or only in the dense ones
(`layers`: Qwen MoE's decoder_sparse_step / mlp_only_layers leave dense layers among the sparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trtforge.models.errors import BuildError


@dataclass(frozen=True)
class WeightRule:
    ours: str
    sources: tuple[str, ...]
    combine: str = "copy"  # copy | concat | conv1d
    when: str | None = None
    """Name of a ModelConfig boolean that must be true for this tensor to exist (e.g. qkv_bias)."""
    unless: str | None = None
    """Name of a ModelConfig boolean that must be false (e.g. tie_word_embeddings for lm_head)."""
    layers: str = "all"
    """Which decoder layers have the tensor: all | dense (the MLP) | moe (the MoE block: ModelConfig.is_moe_layer)."""


@dataclass(frozen=True)
class ArchSpec:
    architecture: str
    family: str
    globals: tuple[WeightRule, ...]
    per_layer: tuple[WeightRule, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    hf_prefixes: tuple[str, ...] = field(default_factory=tuple)
    """Prefixes some checkpoints of the family omit (e.g. `transformer.` in old GPT-2 dumps)."""


_R = WeightRule
_ROPE_GLOBALS = (
    _R("embed_tokens.weight", ("model.embed_tokens.weight",)),
    _R("final_norm.weight", ("model.norm.weight",)),
    _R("lm_head.weight", ("lm_head.weight",), unless="tie_word_embeddings"),
)
_P = "model.layers.{i}."
_ATTENTION = (  # the input norm and attention of Llama-style layers (separate q/k/v projections)
    _R("input_norm.weight", (_P + "input_layernorm.weight",)),
    _R("attn.qkv.weight", tuple(_P + f"self_attn.{x}_proj.weight" for x in "qkv"), "concat"),
    _R("attn.qkv.bias", tuple(_P + f"self_attn.{x}_proj.bias" for x in "qkv"), "concat",
       when="qkv_bias"),
    _R("attn.q_norm.weight", (_P + "self_attn.q_norm.weight",), when="qk_norm"),
    _R("attn.k_norm.weight", (_P + "self_attn.k_norm.weight",), when="qk_norm"),
    _R("attn.o_proj.weight", (_P + "self_attn.o_proj.weight",)),
    _R("attn.o_proj.bias", (_P + "self_attn.o_proj.bias",), when="o_bias"),
)
_ROPE_LAYER = (
    *_ATTENTION,
    _R("post_attn_norm.weight", (_P + "post_attention_layernorm.weight",)),
    _R("mlp.gate_up.weight", (_P + "mlp.gate_proj.weight", _P + "mlp.up_proj.weight"), "concat"),
    _R("mlp.gate_up.bias", (_P + "mlp.gate_proj.bias", _P + "mlp.up_proj.bias"), "concat",
       when="mlp_bias"),
    _R("mlp.down.weight", (_P + "mlp.down_proj.weight",)),
    _R("mlp.down.bias", (_P + "mlp.down_proj.bias",), when="mlp_bias"),
)

# Phi-3 stores q|k|v and gate|up already fused, in the row order of ours (q heads, k heads, v heads;
# gate rows, then up rows: Phi3MLP's chunk(2)), so they are copied as they are.
_PHI3_LAYER = (
    _R("input_norm.weight", (_P + "input_layernorm.weight",)),
    _R("attn.qkv.weight", (_P + "self_attn.qkv_proj.weight",)),
    _R("attn.o_proj.weight", (_P + "self_attn.o_proj.weight",)),
    _R("post_attn_norm.weight", (_P + "post_attention_layernorm.weight",)),
    _R("mlp.gate_up.weight", (_P + "mlp.gate_up_proj.weight",)),
    _R("mlp.down.weight", (_P + "mlp.down_proj.weight",)),
)

# Gemma 2/3: four norms per layer (sandwich_norm). HF's post_attention_layernorm normalises the
# attention output (ours: attn_out_norm); its pre_feedforward_layernorm is the MLP's input norm (ours:
# post_attn_norm, Llama's post_attention_layernorm); post_feedforward_layernorm the MLP output's.
_GEMMA_LAYER = (
    *_ATTENTION,
    _R("attn_out_norm.weight", (_P + "post_attention_layernorm.weight",)),
    _R("post_attn_norm.weight", (_P + "pre_feedforward_layernorm.weight",)),
    _R("mlp.gate_up.weight", (_P + "mlp.gate_proj.weight", _P + "mlp.up_proj.weight"), "concat"),
    _R("mlp.down.weight", (_P + "mlp.down_proj.weight",)),
    _R("mlp_out_norm.weight", (_P + "post_feedforward_layernorm.weight",)),
)

# MoE: the router, every expert's gate|up fused and its down (Mixtral's w1 = gate, w3 = up, w2 = down), Qwen2-MoE's
# shared expert and its sigmoid gate; Qwen MoE's dense layers keep the Llama-style MLP (layers="dense").
_E = _P + "mlp.experts.{e}."
_DENSE_MLP = tuple(replace(r, layers="dense") for r in _ROPE_LAYER if r.ours.startswith("mlp."))
_QWEN_MOE_LAYER = (
    *_ATTENTION,
    _R("post_attn_norm.weight", (_P + "post_attention_layernorm.weight",)),
    *_DENSE_MLP,
    _R("mlp.router.weight", (_P + "mlp.gate.weight",), layers="moe"),
    _R("mlp.experts.{e}.gate_up.weight", (_E + "gate_proj.weight", _E + "up_proj.weight"), "concat", layers="moe"),
    _R("mlp.experts.{e}.down.weight", (_E + "down_proj.weight",), layers="moe"),
)
_S = _P + "mlp.shared_expert."
_QWEN2_MOE_LAYER = (
    *_QWEN_MOE_LAYER,
    _R("mlp.shared_expert.gate_up.weight", (_S + "gate_proj.weight", _S + "up_proj.weight"), "concat", layers="moe"),
    _R("mlp.shared_expert.down.weight", (_S + "down_proj.weight",), layers="moe"),
    _R("mlp.shared_expert_gate.weight", (_P + "mlp.shared_expert_gate.weight",), layers="moe"),
)
_M = _P + "block_sparse_moe."
_MIXTRAL_LAYER = (
    *_ATTENTION,
    _R("post_attn_norm.weight", (_P + "post_attention_layernorm.weight",)),
    _R("mlp.router.weight", (_M + "gate.weight",), layers="moe"),
    _R("mlp.experts.{e}.gate_up.weight", (_M + "experts.{e}.w1.weight", _M + "experts.{e}.w3.weight"), "concat",
       layers="moe"),
    _R("mlp.experts.{e}.down.weight", (_M + "experts.{e}.w2.weight",), layers="moe"),
)

_G = "transformer.h.{i}."
_GPT2_GLOBALS = (
    _R("embed_tokens.weight", ("transformer.wte.weight",)),
    _R("pos_embed.weight", ("transformer.wpe.weight",)),
    _R("final_norm.weight", ("transformer.ln_f.weight",)),
    _R("final_norm.bias", ("transformer.ln_f.bias",)),
    _R("lm_head.weight", ("lm_head.weight",), unless="tie_word_embeddings"),
)
_GPT2_LAYER = (
    _R("input_norm.weight", (_G + "ln_1.weight",)),
    _R("input_norm.bias", (_G + "ln_1.bias",)),
    _R("attn.qkv.weight", (_G + "attn.c_attn.weight",), "conv1d"),
    _R("attn.qkv.bias", (_G + "attn.c_attn.bias",)),
    _R("attn.o_proj.weight", (_G + "attn.c_proj.weight",), "conv1d"),
    _R("attn.o_proj.bias", (_G + "attn.c_proj.bias",)),
    _R("post_attn_norm.weight", (_G + "ln_2.weight",)),
    _R("post_attn_norm.bias", (_G + "ln_2.bias",)),
    _R("mlp.up.weight", (_G + "mlp.c_fc.weight",), "conv1d"),
    _R("mlp.up.bias", (_G + "mlp.c_fc.bias",)),
    _R("mlp.down.weight", (_G + "mlp.c_proj.weight",), "conv1d"),
    _R("mlp.down.bias", (_G + "mlp.c_proj.bias",)),
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM", "llama", _ROPE_GLOBALS, _ROPE_LAYER),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", "mistral", _ROPE_GLOBALS, _ROPE_LAYER),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", "qwen2", _ROPE_GLOBALS, _ROPE_LAYER,
                                 qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec("Qwen3ForCausalLM", "qwen3", _ROPE_GLOBALS, _ROPE_LAYER,
                                 qk_norm=True),
    "Phi3ForCausalLM": ArchSpec("Phi3ForCausalLM", "phi3", _ROPE_GLOBALS, _PHI3_LAYER),
    "Gemma2ForCausalLM": ArchSpec("Gemma2ForCausalLM", "gemma2", _ROPE_GLOBALS, _GEMMA_LAYER),
    "Gemma3ForCausalLM": ArchSpec("Gemma3ForCausalLM", "gemma3", _ROPE_GLOBALS, _GEMMA_LAYER, qk_norm=True),
    "MixtralForCausalLM": ArchSpec("MixtralForCausalLM", "mixtral", _ROPE_GLOBALS, _MIXTRAL_LAYER),
    "Qwen2MoeForCausalLM": ArchSpec("Qwen2MoeForCausalLM", "qwen2_moe", _ROPE_GLOBALS, _QWEN2_MOE_LAYER),
    "Qwen3MoeForCausalLM": ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", _ROPE_GLOBALS, _QWEN_MOE_LAYER,
                                    qk_norm=True),
    "GPT2LMHeadModel": ArchSpec("GPT2LMHeadModel", "gpt2", _GPT2_GLOBALS, _GPT2_LAYER,
                                hf_prefixes=("transformer.",)),
}


def spec_for(architectures: list[str], model_type: str | None = None) -> ArchSpec:
    """The spec of the first supported class in `architectures`, or a clear error."""
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    shown = ", ".join(architectures) or f"(none listed; model_type={model_type!r})"
    raise BuildError(
        f"unsupported architecture {shown}: trtforge builds "
        f"{', '.join(sorted(ARCHITECTURES))}. Check `architectures` in the checkpoint's config.json."
    )
