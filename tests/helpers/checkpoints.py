"""Tiny random Hugging Face checkpoints for tests: real `transformers` models saved with
`save_pretrained(safe_serialization=True)` and a real tokenizer trained offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtforge.builder.demo_checkpoint import ARCHS, MODEL_TYPES
from trtforge.builder.tokenizer_training import train_tiny_tokenizer

_TOKENIZER = None

# Variants covering the acceptance matrix: GQA/MQA/MHA, tied/untied, odd vocab sizes, qkv bias,
# q/k norm with head_dim != hidden/heads, llama3 RoPE scaling, GPT-2 Conv1D + learned positions,
# Phi-3 (fused weights, partial RoPE, LongRoPE), Gemma 2 and Gemma 3 (their switches: ModelConfig).
VARIANTS: dict[str, dict[str, Any]] = {
    "llama-gqa-llama3rope": dict(arch="llama", num_attention_heads=8, num_key_value_heads=2, vocab_size=517,
                                 tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
    "llama-mha-tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mistral-mqa": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=1, vocab_size=521),
    "qwen2-gqa-bias-tied": dict(arch="qwen2", num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-headdim-qknorm": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 vocab_size=523),
    "gpt2-untied": dict(arch="gpt2", n_head=4, vocab_size=519, tie_word_embeddings=False),
    # Phi-3: fused qkv_proj / gate_up_proj copied as they are; partial RoPE (12 of 16 features rotated).
    "phi3-partial-rope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2, vocab_size=527,
                              partial_rotary_factor=0.75),
    # Phi-3 LongRoPE (short factors up to original_max_position_embeddings, which caps the engine at 128).
    "phi3-longrope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=4, vocab_size=525,
                          original_max_position_embeddings=128,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                           "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0]}),
    # Gemma 2: (1 + w) norms, sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar, attention and
    # final-logit soft-capping (small caps so tanh bends), head_dim 24 != 64/4, sliding window 128 (the
    # engine's cap: prompts + outputs stay below it, where HF's sliding layers equal full attention).
    "gemma2-softcap": dict(arch="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                           vocab_size=529, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                           final_logit_softcapping=8.0, sliding_window=128),
    # Gemma 3 (text): q/k norms, two RoPEs (sliding layers: theta 10k; the global one: linear-scaled 1M),
    # MQA, head_dim 32, a final-logit cap, window 96.
    "gemma3-local-rope": dict(arch="gemma3", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=32, vocab_size=531, query_pre_attn_scalar=24, sliding_window=96,
                              final_logit_softcapping=10.0,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1_000_000.0},
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 10_000.0}}),
}


def tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = train_tiny_tokenizer(vocab_size=512)
    return _TOKENIZER


def make_checkpoint(directory: Path, arch: str = "qwen2", seed: int = 0, init_std: float = 0.2,
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of `arch` (a demo-checkpoint arch name) into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    if arch == "gpt2":
        dims: dict[str, Any] = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=len(tok))
    else:
        dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, vocab_size=len(tok))
    dims.update(overrides)
    cfg = AutoConfig.for_model(MODEL_TYPES[arch], **dims, initializer_range=init_std,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    cfg.architectures = [ARCHS[arch]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def make_variant(directory: Path, variant: str, **extra: Any) -> Path:
    spec = dict(VARIANTS[variant])
    return make_checkpoint(directory, **{**spec, **extra})


def build_tiny_engine(directory: Path, arch: str = "llama", *options: str) -> Path:
    """A float32 engine of a tiny random `arch` checkpoint, built in `directory` by the real
    `trtforge build` command (default limits: 64 tokens, 2 MiB of KV; `options` add or override)."""
    from click.testing import CliRunner

    from trtforge.cli.main import main

    ckpt = make_checkpoint(directory / "ckpt", arch)
    out = directory / "engine"
    args = ["build", str(ckpt), "-o", str(out), "--dtype", "float32", "--max-seq-len", "64",
            "--kv-cache-memory", "2MiB", "-q", *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out
