"""Checkpoint → `rank{r}.safetensors` for every tensor-parallel rank (build-engine --tp-size N > 1).

The same plan as convert.py (every tensor checked against the config before anything is written),
then each output tensor is read and combined once and its slice for every rank written to that
rank's file (models/tensor_parallel.py says which slice). Peak memory stays near one combined tensor.
`--tp-size 1` never comes here: convert.py writes rank0.safetensors as it always has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trtforge.builder.architectures import ArchSpec
from trtforge.builder.checkpoint import TensorReader
from trtforge.builder.convert import _combine, plan_with_extras
from trtforge.builder.safetensors_stream import StreamingSafetensorsWriter
from trtforge.models.model_config import ModelConfig
from trtforge.models.tensor_parallel import shard_of, shard_tensor


def convert_sharded(cfg: ModelConfig, spec: ArchSpec, reader: TensorReader, hf_config: Any, dtype: torch.dtype,
                    out_dir: Path, tp: int, progress: bool = True) -> dict[str, int]:
    """Write rank0..rank{tp-1}.safetensors into out_dir; returns convert()'s sizes (weight_bytes:
    all ranks' files together, replicated tensors counted once per rank)."""
    items, extra = plan_with_extras(cfg, spec, reader, hf_config)
    shards = [shard_of(cfg, tp, r) for r in range(tp)]
    writers = []
    try:
        for s in shards:
            layout = [(i.ours, dtype, tuple(shard_tensor(i.ours, torch.empty(i.shape, device="meta"), cfg, s).shape))
                      for i in items] + [(n, t.dtype, tuple(t.shape)) for n, t in extra]
            writers.append(StreamingSafetensorsWriter(out_dir / f"rank{s.rank}.safetensors", layout,
                                                      {"format": "pt", "producer": "trtforge",
                                                       "tp_rank": str(s.rank), "tp_size": str(tp)}))
        params = written = 0
        for item in tqdm(items, desc=f"converting ({tp} ranks)", unit="tensor", disable=not progress):
            tensor = _combine(item, [reader.get(s) for s in item.sources])
            params += tensor.numel()
            for s, writer in zip(shards, writers):
                part = shard_tensor(item.ours, tensor, cfg, s).to(dtype).contiguous()
                writer.write(item.ours, part)
                written += part.numel() * part.element_size()
            del tensor
        for writer in writers:
            for name, t in extra:
                writer.write(name, t)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    return {"parameters": params, "weight_bytes": written,
            "weight_bytes_unquantized": written}
