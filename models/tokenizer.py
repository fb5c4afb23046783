"""Loading an engine's tokenizer (`load_tokenizer`: the one way trtforge loads one), and the engine's two
tokenizer calls without importing transformers, for plain `tokenizers` checkpoints (`PlainTokenizer`).

Why: the engine only ever calls `encode(text, add_special_tokens=False)` and `decode(ids,
skip_special_tokens=...)`. For a tokenizer saved as a plain `tokenizers` backend (tokenizer_class
PreTrainedTokenizerFast / TokenizersBackend, spaces not cleaned up on decode), transformers hands
exactly these to `tokenizers.Tokenizer`, so calling it directly gives the same ids and text.
Importing transformers is ~0.7-1 s of a ~2.5 s `trtforge generate` on a 2-core machine.

Everything else (chat templates, special-token attributes, encode with special tokens, len) comes
from the transformers tokenizer, loaded on first use. Checkpoints with a model-specific class
(Qwen2Tokenizer, LlamaTokenizerFast, …) never come here: their classes add behaviour of their own.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable

PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _plain_config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") not in PLAIN_CLASSES or config.get("clean_up_tokenization_spaces"):
        return None
    return config


class PlainTokenizer:
    """encode/decode straight from `tokenizers`; any other attribute from transformers' tokenizer."""

    def __init__(self, directory: Path, backend: Any):
        self._directory = directory
        self._backend = backend

    @classmethod
    def load(cls, directory: str | Path) -> "PlainTokenizer | None":
        """The fast path for `directory`, or None where transformers must do the loading."""
        from tokenizers import Tokenizer

        directory = Path(directory)
        config = _plain_config(directory)
        if config is None or not (directory / "tokenizer.json").is_file():
            return None
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # Tokens listed only in tokenizer_config.json would be added by transformers at load time
        # and shift nothing here: take the slow path rather than risk different ids.
        for token_id, token in config.get("added_tokens_decoder", {}).items():
            if backend.id_to_token(int(token_id)) != token.get("content"):
                return None
        return cls(directory, backend)

    @functools.cached_property
    def hf(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(self._directory))

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if add_special_tokens or kwargs:  # the post-processor's BOS/EOS etc.: transformers' rules
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.hf)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "hf":  # not set yet (copy/pickle): no recursion into hf
            raise AttributeError(name)
        return getattr(self.hf, name)


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer of an engine (or checkpoint) directory; the one way trtforge loads one. A
    plain `tokenizers` tokenizer (PlainTokenizer) when the files allow, without importing
    transformers; else transformers' AutoTokenizer."""
    plain = PlainTokenizer.load(directory)  # no transformers import for plain `tokenizers` checkpoints
    if plain is not None:
        return plain
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
