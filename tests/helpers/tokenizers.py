"""Real tokenizers for tests, trained offline in a second or two and cached per process.

- :func:`byte_level_tokenizer`: the product's own tiny byte-level BPE
  (:func:`trtforge.builder.tokenizer_training.train_tiny_tokenizer`), GPT-2/Qwen style.
- :func:`sentencepiece_like_tokenizer`: Llama-2 style — "▁" marks spaces (Metaspace), unknown
  characters fall back to ``<0xNN>`` byte tokens, and the decoder strips the leading space of
  the decoded string. This is the style whose per-token decoding loses spaces.
"""

from __future__ import annotations

import json
from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trtforge.builder.tokenizer_training import train_tiny_tokenizer

# English only (plus é): CJK and emoji in test strings must go through byte fallback.
_SP_TRAINING_TEXT = [
    "Hello world, hello streaming world.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop strings end a request; spaces must survive streaming.",
    "Café au lait, s'il vous plaît.",
]
_SP_SPECIALS = ["<unk>", "<s>", "</s>"]


@lru_cache(maxsize=None)
def byte_level_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer the product trains for demo checkpoints."""
    return train_tiny_tokenizer(vocab_size=vocab_size)


@lru_cache(maxsize=None)
def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style Metaspace BPE with byte fallback, as a transformers fast tokenizer."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=_SP_SPECIALS,
                                  show_progress=False)
    backend.train_from_iterator(_SP_TRAINING_TEXT, trainer=trainer)
    # The trainer knows nothing of byte fallback: add the 256 <0xNN> pieces as ordinary tokens.
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ]).__getstate__())
    backend = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )
