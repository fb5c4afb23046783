"""What the OpenAI endpoint serves, read from the Triton repository it fronts.

The repository's `ensemble/config.pbtxt` names the engine directory (parameter `engine_dir`); the
engine directory has the tokenizer (for chat templates and, as a fallback, token counts) and
engine.json (max_seq_len: the most prompt + output tokens of a request). The model id clients use is
the engine directory's name unless the operator chooses one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtforge.frontend.errors import bad_request
from trtforge.frontend.schemas import ChatMessage
from trtforge.model_repo.interface import ENSEMBLE
from trtforge.model_repo.params import ENGINE_DIR
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.errors import EngineLoadError


@dataclass
class ServedModel:
    """The one model behind the endpoint."""

    name: str
    """The model id of the API (GET /v1/models)."""
    engine_dir: Path
    tokenizer: Any
    """The engine's tokenizer, as the engine loads it (models/tokenizer.load_tokenizer)."""
    max_seq_len: int
    """Prompt + output tokens the engine allows per request."""
    triton_model: str = ENSEMBLE
    created: int = field(default_factory=lambda: int(time.time()))

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as the engine encodes a prompt (no special tokens added).

        The endpoints call it on a worker thread. For a plain `tokenizers` tokenizer
        (models/tokenizer.PlainTokenizer) it counts with `encode_batch`, the same ids: `encode`
        holds the GIL for the whole call (measured: a 2M-character prompt stopped every other
        thread for 6.6 s), `encode_batch` releases it (transformers' tokenizers use it already).
        """
        backend = getattr(self.tokenizer, "_backend", None)  # PlainTokenizer's tokenizers.Tokenizer
        if backend is not None and hasattr(backend, "encode_batch"):
            return len(backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, messages: list[ChatMessage]) -> str:
        """The prompt text of a conversation, by the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"The model {self.name!r} has no chat template (its tokenizer in "
                f"{self.engine_dir} defines none), so /v1/chat/completions cannot build a "
                "prompt; use /v1/completions, or add a chat_template to the checkpoint's "
                "tokenizer_config.json (or chat_template.jinja) and rebuild the engine.",
                param="messages")
        conversation = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in messages]
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's raise_exception, missing keys, ...
            raise bad_request(f"The chat template refused these messages: "
                              f"{type(exc).__name__}: {exc}", param="messages") from None


def engine_dir_of(repo: str | os.PathLike) -> Path:
    """The engine directory the repository's `ensemble` model serves."""
    config_path = Path(repo) / ENSEMBLE / "config.pbtxt"
    if not config_path.is_file():
        raise FileNotFoundError(f"{repo} has no {ENSEMBLE}/config.pbtxt; write the repository "
                                "with `trtforge emit-repo ENGINE_DIR REPO_DIR`.")
    value = parameters_of(read_config(config_path)).get(ENGINE_DIR, "")
    if not value:
        raise ValueError(f"{config_path} has no {ENGINE_DIR!r} parameter; re-emit the "
                         "repository with `trtforge emit-repo`.")
    engine_dir = Path(value)
    # Relative paths are relative to the model directory, as the Triton model reads them.
    return engine_dir if engine_dir.is_absolute() else config_path.parent / engine_dir


def load_served_model(repo: str | os.PathLike, name: str | None = None) -> ServedModel:
    """Read the repository and its engine's tokenizer; FileNotFoundError/ValueError say why not."""
    from trtforge.models.tokenizer import load_tokenizer  # heavy; only when serving

    engine_dir = engine_dir_of(repo)
    try:  # verified as the engine loads it before the tokenizer is read from it; the weights'
        # digests are the engine model's to check (it loads them, this process does not)
        engine = read_engine_config(engine_dir, verify_weights=False)
    except EngineLoadError as exc:
        raise ValueError(f"the repository's {ENGINE_DIR}: {exc}") from None
    return ServedModel(
        name=name or engine_dir.resolve().name,
        engine_dir=engine_dir,
        tokenizer=load_tokenizer(engine_dir),
        max_seq_len=engine.max_seq_len,
    )
