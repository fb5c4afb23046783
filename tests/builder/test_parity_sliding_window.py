"""Sliding-window models on prompts longer than their window: the engine against transformers' eager
attention (which applies the window: checked by comparing it with the same weights at full attention).
Mistral (every layer windowed), Qwen2 with use_sliding_window / max_window_layers (layer 0 full, layer 1
windowed), Gemma 2 (alternating sliding / full layers, soft-capped)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.builder.test_parity import _engine, _prompt_logits
from tests.helpers.checkpoints import make_variant
from trtforge.config.sampling import SamplingParams

DEVICE = os.environ.get("TRTFORGE_TEST_DEVICE", "cpu")
WINDOW = 16
PROMPT_LENGTHS = (40, 21, 45)  # two longer than the window
MAX_NEW = 24
CASES = {
    # name: (variant, checkpoint overrides, overrides that turn the window off for the full-attention oracle)
    "mistral": ("mistral-mqa", dict(sliding_window=WINDOW), dict(sliding_window=None)),
    "qwen2": ("qwen2-gqa-bias-tied", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              dict(layer_types=["full_attention"] * 2)),
    "gemma2": ("gemma2-softcap", dict(sliding_window=WINDOW), dict(layer_types=["full_attention"] * 2)),
}


def _hf(ckpt, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager",
                                                **overrides).to(DEVICE).eval()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(5, min(vocab, 500), (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("name", sorted(CASES))
def test_windowed_model_matches_transformers_past_its_window(tmp_path, name):
    variant, overrides, full_overrides = CASES[name]
    ckpt = make_variant(tmp_path / "ckpt", variant, **overrides)
    hf, hf_full = _hf(ckpt), _hf(ckpt, **full_overrides)
    engine = _engine(tmp_path, ckpt)
    model = engine.engine_config.model
    assert model.layer_windows and max(model.layer_windows) == WINDOW
    assert engine.engine_config.build["max_seq_len"] > max(PROMPT_LENGTHS) + MAX_NEW, "no cap at the window"
    prompts = _prompts(model.vocab_size)
    with torch.no_grad():
        for p, got in zip(prompts, _prompt_logits(engine, prompts)):
            ids = torch.tensor([p], device=DEVICE)
            ref = hf(ids).logits[0].float()
            if len(p) > WINDOW:  # the oracle really applies the window
                assert (hf_full(ids).logits[0].float() - ref).abs().max().item() > 1e-3
            assert (got - ref).abs().max().item() < 1e-4, f"{name}: prompt logits differ for {len(p)} tokens"
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.output_token_ids == _hf_greedy(hf, p, MAX_NEW), \
            f"{name}: greedy tokens differ for a {len(p)}-token prompt"


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers' model run on the whole sequence at every step (its eager attention
    applies the window through its mask). Not `generate`: with its sliding-window KV cache, Mistral's
    `generate` left its own full-sequence greedy at the 4th token of a 40-token prompt (transformers 5.x)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax()))
    return ids[len(prompt):]
