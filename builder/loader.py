"""Load a verified engine directory into a runnable network (torch backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .convert import TORCH_DTYPES
from .engine_dir import EngineConfig
from .errors import EngineLoadError
from .network import CausalLM


def load_network(directory: str | Path, cfg: EngineConfig, device: str | torch.device = "cpu") -> CausalLM:
    from safetensors.torch import load_file

    weights = Path(directory) / "rank0.safetensors"
    if not weights.is_file():
        raise EngineLoadError(f"{directory} has no rank0.safetensors (backend {cfg.backend!r}); the torch "
                              f"runtime needs the torch backend's weights.")
    with torch.device("meta"):
        model = CausalLM(cfg.model)
    state = load_file(str(weights), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise EngineLoadError(f"{weights} does not fit the network: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}. Rebuild the engine.")
    return model.eval()


def load_tokenizer(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def torch_dtype(cfg: EngineConfig) -> torch.dtype:
    return TORCH_DTYPES[cfg.dtype]
