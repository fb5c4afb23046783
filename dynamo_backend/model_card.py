"""The model folder Dynamo's frontend reads for a trtforge engine: config.json and the tokenizer.

The frontend tokenizes prompts and detokenizes our tokens itself, from a Hugging Face-style
folder (config.json, tokenizer.json, tokenizer_config.json, generation_config.json, the chat
template). An engine directory holds the tokenizer files (verified against engine.json's sha256
when the engine loaded) but no config.json, so the worker writes a folder with a config.json made
from engine.json's model description and copies of those files.

The frontend accepts a second worker for a model only if its card has the same checksum, which
covers the card's path: so every worker of one engine writes the same folder, named by the digest
of the engine's engine.json (and the context length it serves), in trtforge's private cache
directory (0700, this user's own: plugins/native.private_dir). It is written beside and renamed
into place, so workers starting together never see half a card.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from trtforge.models.engine_dir import ENGINE_JSON, EngineConfig, is_weights
from trtforge.plugins.native import cache_root, private_dir

_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "mistral": "mistral", "gpt2": "gpt2"}


def card_dir(engine_dir: Path, max_seq_len: int) -> Path:
    """Where the workers of this engine keep its card (the same path for every one of them)."""
    digest = hashlib.sha256((Path(engine_dir) / ENGINE_JSON).read_bytes() + b"%d" % max_seq_len).hexdigest()[:16]
    return private_dir(cache_root() / "dynamo-cards") / digest


def write_model_card(engine_dir: Path, cfg: EngineConfig, max_seq_len: int, directory: Path | None = None) -> Path:
    """The card folder of `engine_dir` (`directory`, else card_dir's), written unless present."""
    out = Path(directory) if directory else card_dir(engine_dir, max_seq_len)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".card-", dir=out.parent))
    model = cfg.model
    config = {
        "architectures": [model.architecture], "model_type": _MODEL_TYPES.get(model.family, model.family),
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": max_seq_len, "bos_token_id": model.bos_token_id,
        "eos_token_id": list(model.eos_token_ids) if len(model.eos_token_ids) != 1 else model.eos_token_ids[0],
        "pad_token_id": model.pad_token_id, "tie_word_embeddings": model.tie_word_embeddings,
        "torch_dtype": cfg.dtype,
    }
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        for name in cfg.files:
            if not is_weights(name):
                shutil.copyfile(Path(engine_dir) / name, staging / name)
        os.rename(staging, out)  # atomic; fails if another worker got there first: theirs is the same
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
