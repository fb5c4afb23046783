"""The engine dtypes: their names in engine.json, their sizes and torch types (torch-free until a
torch type is asked for: the CLI and the KV sizing import this)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def torch_dtype(name: str) -> torch.dtype:
    """torch.float32 for "float32", etc. (KeyError for a name that is not an engine dtype)."""
    import torch  # keeps this module importable without torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
