"""Rotary position embeddings.

The inverse frequencies are computed once at build time — with transformers' own RoPE functions
for the scaled variants (llama3, yarn, linear, …), so they match the HF model exactly — and stored
in the engine as the tensor `rope.inv_freq`. At run time only `positions × inv_freq` is left.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.models.errors import BuildError


def compute_inv_freq(hf_config: Any, rope_type: str, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention_scaling) for a supported RoPE type."""
    if float(getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise BuildError("partial rotary embeddings (partial_rotary_factor < 1) are not supported.")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, D] for the packed tokens' absolute positions."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the half-split convention used by HF Llama/Qwen/Mistral."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
