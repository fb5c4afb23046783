"""Rotary position embeddings.

The inverse frequencies are computed once at build time — with transformers' own RoPE functions
for the scaled variants (llama3, yarn, linear, …), so they match the HF model exactly — and stored
in the engine as the tensor `rope.inv_freq`. At run time only `positions × inv_freq` is left.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.models.errors import BuildError


def compute_inv_freq(hf_config: Any, rope_type: str, theta: float, rotary_dim: int,
                     layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, attention_scaling) for a supported RoPE type. rotary_dim: the
    features rotated (head_dim, or less with Phi-3's partial_rotary_factor; builder/hf_config.py reads it
    and refuses it for the families without it). layer_type: the layer type whose parameters a config with
    per-type RoPE holds (Gemma 3: "full_attention" / "sliding_attention"), passed on to transformers."""
    if rope_type == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (theta ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    if inv_freq.numel() * 2 != rotary_dim:
        raise BuildError(f"RoPE {rope_type!r}: transformers computed {inv_freq.numel()} frequencies for "
                         f"{rotary_dim} rotated features per head; the config is inconsistent.")
    return inv_freq.float(), float(scaling)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, D] for the packed tokens' absolute positions."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the half-split convention used by HF Llama/Qwen/Mistral/Gemma. With
    cos/sin narrower than D (partial RoPE, Phi-3) the first cos.shape[-1] features are rotated and
    the rest pass through unchanged, as transformers' Phi-3 does."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
