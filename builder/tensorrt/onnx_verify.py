"""Check an exported graph numerically on CPU: ONNX Runtime (+ the PagedAttention PyOp) against
the torch network it came from, over a prefill step, a decode step, a mixed step, a step that
samples no row (the first chunk of a longer prompt) and the chunk that finishes that prompt.

Both sides start from zeroed KV pools. The torch network updates its pools in place; the ONNX
graph returns `kv_cache_out_{i}`, which is fed back as `kv_cache_{i}` on the next step (what
TensorRT does by aliasing). Logits must agree step by step, and the pools at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trtforge.builder.tensorrt.onnx_export import LOGITS, kv_input_name, kv_output_name
from trtforge.plugins.paged_attention.metadata import AttentionMetadata

# (sequence id, new tokens[, samples]) per step: two prompts; both decode; seq 0 decodes while a
# third prompt is prefilled in the same step; a fourth prompt's first chunk, which stops short of
# its end and so samples no row (logits_indices is empty: the step the TensorRT executor must
# still run, serving/worker/trt_step.py); the chunk that finishes it.
DEFAULT_STEPS: tuple[tuple[tuple, ...], ...] = (
    ((0, 5), (1, 3)),
    ((0, 1), (1, 1)),
    ((0, 1), (2, 4)),
    ((3, 4, False),),
    ((3, 2),),
)


def _chunk(spec: tuple) -> tuple[int, int, bool]:
    """(seq, new tokens, samples) of one DEFAULT_STEPS entry (samples defaults to True)."""
    seq, new, *rest = spec
    return seq, new, bool(rest[0]) if rest else True


@dataclass
class StepResult:
    """Agreement of one step."""

    new_tokens: list[int]
    """New tokens per sequence in this step."""
    rows: int
    """Logits rows compared (0 for a step that samples none: only its KV counts)."""
    max_abs_diff: float
    """max |logits_onnx - logits_torch| over the step's rows."""
    max_abs_logit: float
    """max |logits_torch|, for scale."""


@dataclass
class VerifyReport:
    """What `verify` compared and how closely the two agreed."""

    steps: list[StepResult] = field(default_factory=list)
    kv_max_abs_diff: float = 0.0
    """max |pool_onnx - pool_torch| over all layers after the last step."""
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def ok(self) -> bool:
        bound = [self.atol + self.rtol * s.max_abs_logit for s in self.steps]
        return (all(s.max_abs_diff <= b for s, b in zip(self.steps, bound))
                and self.kv_max_abs_diff <= self.atol + self.rtol)

    def summary(self) -> str:
        lines = [f"step {i}: new tokens {s.new_tokens}, " + (
                     f"max |Δlogits| = {s.max_abs_diff:.3g} (max |logit| {s.max_abs_logit:.3g})"
                     if s.rows else "no row sampled (KV only)") for i, s in enumerate(self.steps)]
        lines.append(f"KV pools after the last step: max |Δ| = {self.kv_max_abs_diff:.3g}")
        lines.append(f"tolerance: atol {self.atol:g} + rtol {self.rtol:g}·max|logit| -> "
                     + ("OK" if self.ok else "MISMATCH"))
        return "\n".join(lines)


class _Batcher:
    """Just enough bookkeeping to build packed batches: contiguous blocks per sequence."""

    def __init__(self, block_size: int, blocks_per_seq: int):
        self.block_size, self.width = block_size, blocks_per_seq
        self.lengths: dict[int, int] = {}

    def table(self, seq: int) -> list[int]:
        # Block 0 is left unused: it is what padded table entries point at.
        return [1 + seq * self.width + j for j in range(self.width)]

    def step(self, spec, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        ids, positions, slots, tables, seq_lens, qsl, rows = [], [], [], [], [], [0], []
        for seq, new, samples in map(_chunk, spec):
            cached = self.lengths.get(seq, 0)
            if cached + new > self.width * self.block_size:
                raise ValueError(f"sequence {seq} would outgrow its {self.width} blocks")
            table = self.table(seq)
            for p in range(cached, cached + new):
                positions.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += torch.randint(0, vocab, (new,), generator=gen).tolist()
            self.lengths[seq] = cached + new
            tables.append(table)
            seq_lens.append(cached + new)
            qsl.append(qsl[-1] + new)
            if samples:
                rows.append(qsl[-1] - 1)
        return {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions),
                "slot_mapping": torch.tensor(slots),
                "block_tables": torch.tensor(tables, dtype=torch.int32),
                "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
                "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
                "logits_indices": torch.tensor(rows, dtype=torch.int64)}


def verify(model: torch.nn.Module, onnx_path: str | Path, *, block_size: int,
           steps=DEFAULT_STEPS, atol: float = 1e-4, rtol: float = 1e-4,
           seed: int = 0) -> VerifyReport:
    """Run `steps` through `model` (float32 CausalLM) and the graph; compare. Never raises on a
    mismatch: read `report.ok`."""
    from trtforge.plugins.paged_attention.onnx_ort import make_session

    cfg = model.cfg
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("ONNX Runtime validation runs the PagedAttention PyOp in float32 only; "
                         "export with `--dtype float32` to verify")
    totals: dict[int, int] = {}
    for spec in steps:
        for seq, new, _ in map(_chunk, spec):
            totals[seq] = totals.get(seq, 0) + new
    width = math.ceil(max(totals.values()) / block_size)
    pool_shape = (2, 1 + (max(totals) + 1) * width, block_size, cfg.num_kv_heads, cfg.head_dim)
    torch_pools = [torch.zeros(pool_shape) for _ in range(cfg.num_layers)]
    onnx_pools = [np.zeros(pool_shape, dtype=np.float32) for _ in range(cfg.num_layers)]
    import onnx

    graph_dtype = {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False)
                   .metadata_props}.get("trtforge.dtype", "float32")
    if graph_dtype != "float32":
        raise ValueError(f"{onnx_path} was exported in {graph_dtype}; the ONNX Runtime check runs float32 "
                         "only: export again with `--dtype float32` to verify")
    session = make_session(onnx_path)
    batcher, gen = _Batcher(block_size, width), torch.Generator().manual_seed(seed)
    report = VerifyReport(atol=atol, rtol=rtol)
    for spec in steps:
        batch = batcher.step(spec, cfg.vocab_size, gen)
        meta = AttentionMetadata(batch["slot_mapping"], batch["block_tables"], batch["seq_lens"],
                                 batch["query_start_loc"], max(c[1] for c in spec),
                                 int(batch["seq_lens"].max()))
        with torch.no_grad():
            expected = model(batch["input_ids"], batch["positions"], torch_pools, meta,
                             batch["logits_indices"]).numpy()
        feed = {name: t.numpy() for name, t in batch.items()}
        feed.update({kv_input_name(i): p for i, p in enumerate(onnx_pools)})
        names = [LOGITS, *(kv_output_name(i) for i in range(cfg.num_layers))]
        logits, *onnx_pools = session.run(names, feed)
        rows = int(expected.shape[0])
        if logits.shape != expected.shape:
            raise ValueError(f"the graph returned logits of shape {logits.shape} for a step whose torch "
                             f"logits are {expected.shape}")
        report.steps.append(StepResult([c[1] for c in spec], rows,
                                       float(np.abs(logits - expected).max()) if rows else 0.0,
                                       float(np.abs(expected).max()) if rows else 0.0))
    report.kv_max_abs_diff = max(float(np.abs(o - t.numpy()).max())
                                 for o, t in zip(onnx_pools, torch_pools))
    return report
