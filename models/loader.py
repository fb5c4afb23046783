"""Load a verified engine directory into a runnable network (torch backend)."""

from __future__ import annotations

from pathlib import Path

import torch

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.errors import EngineLoadError
from trtforge.models.layers import Layers, pack_weights
from trtforge.models.network import CausalLM
from trtforge.models.skip_init import build_on_meta, still_on_meta
from trtforge.models.tensor_parallel import shard_of


def load_network(directory: str | Path, cfg: EngineConfig, device: str | torch.device = "cpu",
                 rank: int = 0, *, kernels: str = "reference") -> CausalLM:
    """The network of tensor-parallel rank `rank` (the whole model when tp_size is 1); on its own it
    computes partial sums: the runtime attaches the collectives (serving/worker/tp_executor.py).

    kernels: "reference" builds plain torch layers (what export and conversion trace); "auto" the
    kernels registry's choice for `device` and the engine's dtype (plugins/kernels.py), what the
    runtime runs — the one place that choice is made (models/layers.py: Layers.for_engine)."""
    from safetensors.torch import load_file

    if not 0 <= rank < cfg.tp_size:
        raise EngineLoadError(f"rank {rank} does not exist in {directory}: the engine has tp_size {cfg.tp_size}.")
    weights = Path(directory) / f"rank{rank}.safetensors"
    if not weights.is_file():
        raise EngineLoadError(f"{directory} has no {weights.name} (backend {cfg.backend!r}); the torch "
                              f"runtime needs the torch backend's weights.")
    # Built on meta without initialisation, then the file's tensors assigned: on CPU they stay
    # mapped from the page cache (safetensors maps the file), so loading copies nothing.
    layers = Layers.for_engine(cfg, device, kernels)  # before build_on_meta: it may import Triton
    model = build_on_meta(lambda: _network(cfg, layers, rank))
    state = load_file(str(weights), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = sorted(set(missing) | set(still_on_meta(model)))  # e.g. a buffer the file lacks
    if missing or unexpected:
        raise EngineLoadError(f"{weights} does not fit the network: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}. Rebuild the engine.")
    pack_weights(model)  # the CPU kernels' layout (no-op for reference and CUDA layers)
    return model.eval()


def _network(cfg: EngineConfig, layers: Layers, rank: int = 0) -> CausalLM:
    shard = shard_of(cfg.model, cfg.tp_size, rank) if cfg.tp_size > 1 else None
    return CausalLM(cfg.model, shard, layers)  # quantized engines: QuantLinears from `layers`
