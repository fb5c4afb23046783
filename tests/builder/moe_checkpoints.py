"""Tiny random Mixture-of-Experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) for the MoE tests: transformers'
own config and model classes, saved with `save_pretrained(safe_serialization=True)` (the hub's per-expert
layout), with the shared tiny tokenizer. Odd vocabularies and head sizes; routers random (Qwen's start at
zero, which would make every expert tie)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.checkpoints import tokenizer

MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # Mixtral: 6 experts, top-2 renormalised, head_dim 24 (not hidden / heads), GQA, untied.
    "mixtral": dict(model_type="mixtral", arch="MixtralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    head_dim=24, vocab_size=533, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                    sliding_window=None),
    # Qwen2-MoE: qkv bias, top-2 not renormalised, a shared expert with its sigmoid gate, layer 1 dense
    # (mlp_only_layers) among three.
    "qwen2_moe": dict(model_type="qwen2_moe", arch="Qwen2MoeForCausalLM", num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=535, intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=40, shared_expert_intermediate_size=56, norm_topk_prob=False,
                      mlp_only_layers=[1], tie_word_embeddings=True),
    # Qwen3-MoE: q/k norms, head_dim 20, 8 experts top-3 renormalised, no shared expert, MQA.
    "qwen3_moe": dict(model_type="qwen3_moe", arch="Qwen3MoeForCausalLM", num_attention_heads=4,
                      num_key_value_heads=1, head_dim=20, vocab_size=537, intermediate_size=96, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
}


def make_moe_checkpoint(directory: Path, variant: str, seed: int = 0, init_std: float = 0.2,
                        **overrides: Any) -> Path:
    """Write the tiny random checkpoint `variant` of MOE_VARIANTS into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**MOE_VARIANTS[variant], **overrides}
    model_type, arch = spec.pop("model_type"), spec.pop("arch")
    tok = tokenizer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    dims = {"hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 512, **spec}
    cfg = AutoConfig.for_model(model_type, **dims, initializer_range=init_std, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF initialises norms to 1, biases to 0
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("gate.weight", "shared_expert_gate.weight")):  # routers: random, spread out
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory
