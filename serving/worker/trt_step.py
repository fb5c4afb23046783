"""One step of a `--backend tensorrt` plan as plain tensors: its profile, its inputs, its rows.

Shared by the TensorRT executor (trt_executor.py) and its ONNX Runtime sibling (trt_ort.py), so
that what the GPU path binds is what the CPU tests run.

A step that samples no token. A prefill chunk that stops short of the end of its prompt adds no
logits row (model_inputs.py), and the engine still runs the step, because the chunk's KV must be
written. Such a step has an empty `logits_indices`, but both optimisation profiles of the plan
(builder/tensorrt/build.py) start `logits_indices` at length 1, so TensorRT refuses the shape.
`plan_step` asks for one row (the step's last token) instead, and the caller returns the first
`rows` of what comes back: none. An engine built before this change needs no rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtforge.plugins.paged_attention.metadata import AttentionMetadata

META = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
        "logits_indices")
INT_DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
              "logits_indices": torch.int64, "block_tables": torch.int32, "seq_lens": torch.int32,
              "query_start_loc": torch.int32}
SHAPE_HINT = ("(build limits in engine.json: max_batch_size, max_num_tokens, max_seq_len, "
              "kv_cache_memory); rebuild with larger limits")


@dataclass
class PlanStep:
    """The inputs of one step as the plan takes them."""

    feeds: dict[str, torch.Tensor]
    """The graph's meta inputs, contiguous, in the plan's integer dtypes, on `device`."""
    profile: int
    """0: decode profile (at most max_batch_size tokens); 1: prefill/mixed profile."""
    rows: int
    """Logits rows the caller asked for; the plan computes max(rows, 1)."""


def profile_for(num_tokens: int, decode_max_tokens: int, max_num_tokens: int) -> int:
    """The optimisation profile of a step of `num_tokens` tokens (ValueError beyond the engine's)."""
    if num_tokens > max_num_tokens:
        raise ValueError(f"a step of {num_tokens} tokens exceeds the engine's max_num_tokens "
                         f"{max_num_tokens}; lower the scheduler's token budget or rebuild the engine "
                         "with a larger --max-num-tokens")
    return 0 if num_tokens <= decode_max_tokens else 1


def plan_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logits_indices: torch.Tensor, device: torch.device, decode_max_tokens: int,
              max_num_tokens: int) -> PlanStep:
    """The feeds of one step (see module doc for a step that samples no row)."""
    num_tokens = int(input_ids.shape[0])
    rows = int(logits_indices.shape[0])
    if rows == 0:
        logits_indices = torch.tensor([num_tokens - 1], dtype=torch.int64)
    tensors = dict(zip(META, (input_ids, positions, meta.slot_mapping, meta.block_tables,
                              meta.seq_lens, meta.query_start_loc, logits_indices)))
    # Kept alive by the caller until the step has run: TensorRT holds raw pointers.
    feeds = {name: t.to(device=device, dtype=INT_DTYPES[name]).contiguous()
             for name, t in tensors.items()}
    return PlanStep(feeds, profile_for(num_tokens, decode_max_tokens, max_num_tokens), rows)


def outside_profile(name: str, shape: tuple[int, ...]) -> ValueError:
    """The error for an input the plan's profile does not take (TensorRT's set_input_shape False)."""
    return ValueError(f"input {name} of shape {shape} is outside the shapes this engine was built "
                      f"for {SHAPE_HINT}")


def check_in_profile(profile: dict[str, tuple[tuple[int, ...], ...]], name: str,
                     shape: tuple[int, ...]) -> None:
    """What TensorRT's IExecutionContext.set_input_shape checks: the rank, then every dimension
    within the profile's [min, max]; ValueError (outside_profile) otherwise."""
    lo, _opt, hi = profile[name]
    if len(shape) != len(lo) or any(not a <= d <= b for a, d, b in zip(lo, shape, hi)):
        raise outside_profile(name, shape)
