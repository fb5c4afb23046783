"""Tiny random Hugging Face checkpoints for tests: real `transformers` models saved with
`save_pretrained(safe_serialization=True)` and a real tokenizer trained offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtforge.builder.demo_checkpoint import ARCHS
from trtforge.builder.tokenizer_training import train_tiny_tokenizer

_TOKENIZER = None

# Variants covering the acceptance matrix: GQA/MQA/MHA, tied/untied, odd vocab sizes, qkv bias,
# q/k norm with head_dim != hidden/heads, llama3 RoPE scaling, GPT-2 Conv1D + learned positions.
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
    cfg = AutoConfig.for_model(arch if arch != "gpt2" else "gpt2", **dims, initializer_range=init_std,
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
