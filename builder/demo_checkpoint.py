"""`trtforge demo-checkpoint`: a RANDOM-WEIGHT Hugging Face checkpoint with a real trained tokenizer.

For the quickstart, the tests and the benchmarks on machines without a model hub. The weights are
random (their outputs are meaningless); the shapes can be those of a real model (`--size 0.5b` =
Qwen2.5-0.5B's config, vocabulary included), which is all that speed depends on. The tokenizer is
trained on a bundled English text (demo_text.py), and the tiny model's vocabulary is exactly the
tokenizer's, so what it prints is words. Every directory it writes carries a README and a
`trtforge_demo` field in config.json saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtforge.builder.demo_text import corpus_lines, speak_only_words, train_briefly
from trtforge.builder.tokenizer_training import CHAT_TEMPLATE, train_tiny_tokenizer
from trtforge.models.errors import BuildError

ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
         "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
         "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
         "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MODEL_TYPES = {arch: arch for arch in ARCHS} | {"gemma3": "gemma3_text"}
"""transformers' model_type (AutoConfig.for_model) of each --arch: Gemma 3's text-only model is gemma3_text."""

# The published configs' shapes (Qwen2.5-0.5B; Llama/GPT-2 at a similar 0.5B-class size).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "rope": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048),
        "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=2048),
    },
    "0.5b": {
        "rope": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
        "gpt2": dict(vocab_size=50257, n_embd=1280, n_layer=20, n_head=20, n_positions=4096),
    },
}


def hf_config(arch: str, size: str, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise BuildError(f"--arch {arch!r} is unknown: choose one of {', '.join(ARCHS)}.")
    if size not in SIZES:
        raise BuildError(f"--size {size!r} is unknown: choose one of {', '.join(SIZES)}.")
    model_type = MODEL_TYPES[arch]
    dims = dict(SIZES[size]["gpt2" if arch == "gpt2" else "rope"])
    dims.setdefault("vocab_size", len(tokenizer))
    if arch in ("qwen3", "gemma2", "gemma3"):  # head_dim independent of hidden / heads, as in the real models
        dims.setdefault("head_dim", 2 * dims["hidden_size"] // dims["num_attention_heads"])
    if arch in ("gemma2", "gemma3"):
        dims.setdefault("query_pre_attn_scalar", dims["head_dim"])
        dims.setdefault("tie_word_embeddings", True)
    if arch == "gemma3":  # a global layer among the sliding ones (Gemma 3 has 5 sliding : 1 global)
        dims.setdefault("layer_types", ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                        for i in range(dims["num_hidden_layers"])])
    if arch == "mistral":
        dims["sliding_window"] = None
    if arch == "mixtral":  # Mixtral's shape: 8 experts, top-2, each of intermediate_size
        dims.update(num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch in ("qwen2_moe", "qwen3_moe"):  # fine-grained experts a quarter of the dense width
        dims.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=dims["intermediate_size"] // 4)
    if arch == "qwen2_moe":
        dims["shared_expert_intermediate_size"] = dims["intermediate_size"]
    cfg = AutoConfig.for_model(model_type, **dims, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg.architectures = [ARCHS[arch]]
    return cfg


def write_demo_checkpoint(out: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0,
                          dtype: str = "float32", train_seconds: float = 0.0) -> Path:
    """Random weights; `tiny` can only say whole words (demo_text.speak_only_words) unless
    train_seconds > 0 fits it to the bundled text for that long instead."""
    from transformers import AutoModelForCausalLM

    if train_seconds > 0 and size != "tiny":
        raise BuildError("--train-seconds needs --size tiny: a 0.5B model learns nothing in seconds on a CPU.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # One tokenizer for every size, trained on the bundled English: its pieces are whole words.
    tokenizer = train_tiny_tokenizer(vocab_size=4096, texts=corpus_lines())
    cfg = hf_config(arch, size, tokenizer)  # tiny: vocab = the tokenizer's size; 0.5b: Qwen's 151,936
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    how = "random weights"
    if train_seconds > 0:
        steps = train_briefly(model, tokenizer, train_seconds, seed)
        how = f"random weights trained {train_seconds:g} s ({steps} steps) on the bundled demo text"
    elif size == "tiny":
        speak_only_words(model, tokenizer)
        how = "random weights (LM head limited to whole words)"
    cfg.trtforge_demo = f"{how}: outputs are meaningless; for tests, demos and benchmarks"
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    (out / "README.md").write_text(
        f"# trtforge demo checkpoint ({arch}, {size}) — {how.upper()}\n\n"
        f"Made by `trtforge demo-checkpoint` with seed {seed}. The weights are not a trained model,\n"
        f"so generated text is meaningless; the shapes and the tokenizer (trained locally on the\n"
        f"bundled English text) are real.\n")
    return out


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """save_pretrained, plus the chat template inside tokenizer_config.json: recent transformers
    write it to chat_template.jinja only, which older ones (and other tools) do not read."""
    import json

    tokenizer.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
