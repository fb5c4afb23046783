"""Phi-3, Gemma 2 and Gemma 3 beyond their HF parity (tests/builder/test_parity.py runs their variants):
what the config reading records, what it refuses by name, int8 weight-only engines of the new families,
and the demo checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from tests.builder.test_parity import _prompt_logits, _prompts
from tests.helpers.checkpoints import make_checkpoint, make_variant
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.models.model_config import ModelConfig
from trtforge.models.quantized_layers import QuantEmbedding, QuantLinear
from trtforge.serving.engine import LLMEngine


def _build(ckpt, out, **options):
    cfg = BuildConfig(**{"dtype": "float32", "max_batch_size": 8, "max_num_tokens": 256, "kv_cache_memory": "16MiB",
                         **options})
    return build_engine(str(ckpt), out, cfg, progress=False)


@pytest.mark.parametrize("variant", ["gemma2-softcap", "phi3-partial-rope"])
def test_int8_weight_only_engine_runs_close_to_the_float_one(tmp_path, variant):
    """int8_wo of a tied Gemma 2 (the quantized head also gives the scaled embeddings) and of Phi-3 (its fused
    weights quantized like ours): batched prompts and greedy decoding run; prompt logits stay near the float
    engine's (measured: 3 % of the largest logit for Gemma 2, 9 % for Phi-3, int8 activations included)."""
    ckpt = make_variant(tmp_path / "ckpt", variant)
    fp, _ = _build(ckpt, tmp_path / "fp")
    q8, cfg = _build(ckpt, tmp_path / "int8", quantization="int8_wo")
    meta = json.loads((q8 / "engine.json").read_text())
    assert meta["quantization"]["scheme"] == "int8_wo"
    float_engine, int8_engine = LLMEngine.from_engine_dir(fp), LLMEngine.from_engine_dir(q8)
    net = int8_engine.executor.network
    assert isinstance(net.layers[0].attn.qkv, QuantLinear) and isinstance(net.layers[0].mlp.gate_up, QuantLinear)
    if cfg.model.tie_word_embeddings:
        assert isinstance(net.embed_tokens, QuantEmbedding)
    prompts = _prompts(cfg.model.vocab_size)
    ours, ref = _prompt_logits(int8_engine, prompts), _prompt_logits(float_engine, prompts)
    largest = max(r.abs().max().item() for r in ref)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 0.2 * largest
    outs = int8_engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [8] * len(prompts)


def test_config_reading_records_the_switches(tmp_path):
    ckpt = make_variant(tmp_path / "g3", "gemma3-local-rope")
    _, cfg = _build(ckpt, tmp_path / "e3")
    m = cfg.model
    assert (m.family, m.norm_weight_offset, m.sandwich_norm, m.qk_norm, m.activation) == ("gemma3", 1.0, True, True,
                                                                                          "gelu_tanh")
    assert m.embedding_multiplier == pytest.approx(64 ** 0.5) and m.attention_scale == pytest.approx(24 ** -0.5)
    assert (m.rope_type, m.rope_theta, m.rope_local_type, m.rope_local_theta) == ("linear", 1e6, "default", 1e4)
    assert m.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert m.layer_windows == [96, 0, 96]  # the sliding layers attend within their window
    assert cfg.build["max_seq_len"] == m.max_position_embeddings > 96  # so nothing caps the sequence at it
    net = LLMEngine.from_engine_dir(tmp_path / "e3").executor.network
    assert [layer.local_rope for layer in net.layers] == [True, False, True]
    assert not torch.equal(net.rope_inv_freq, net.rope_local_inv_freq)
    assert "attn_logit_softcapping" not in m.switches_beyond_llama()  # Gemma 3: not set
    # an engine.json written before these fields existed reads with every switch off
    old = {k: v for k, v in m.to_dict().items() if k in ModelConfig.__dataclass_fields__
           and k not in ("rotary_dim", "norm_weight_offset", "embedding_multiplier", "sandwich_norm",
                         "attention_scale", "attn_logit_softcapping", "final_logit_softcapping", "layer_types",
                         "rope_local_type", "rope_local_theta", "rope_local_attention_scaling", "rope_max_seq_len")}
    assert ModelConfig.from_dict(old).switches_beyond_llama() == []


def test_longrope_is_capped_at_its_original_context(tmp_path):
    ckpt = make_variant(tmp_path / "ckpt", "phi3-longrope")
    _, cfg = _build(ckpt, tmp_path / "e")
    assert cfg.model.rope_type == "longrope" and cfg.model.rope_max_seq_len == 128
    assert cfg.build["max_seq_len"] == 128 and cfg.model.rope_attention_scaling > 1.0  # sqrt(1 + ln 4 / ln 128)
    with pytest.raises(BuildError, match="LongRoPE original_max_position_embeddings \\(128\\).*long_factor"):
        _build(ckpt, tmp_path / "long", max_seq_len=256)
    assert not (tmp_path / "long").exists()


@pytest.mark.parametrize("arch,overrides,needle", [
    ("gemma3", dict(head_dim=32, attn_logit_softcapping=50.0), "Gemma 3 does not apply it"),
    ("gemma2", dict(head_dim=32, use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "partial rotary embeddings"),
])
def test_what_is_refused_is_refused_by_name(tmp_path, arch, overrides, needle):
    ckpt = make_checkpoint(tmp_path / "ckpt", arch, **overrides)
    with pytest.raises(BuildError, match=needle):
        _build(ckpt, tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_soft_capped_models_are_refused_for_tensorrt(tmp_path):
    ckpt = make_variant(tmp_path / "ckpt", "gemma2-softcap")
    with pytest.raises(BuildError, match="TensorRT PagedAttention plugin does not take"):
        _build(ckpt, tmp_path / "e", backend="tensorrt")


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3"])
def test_demo_checkpoint_of_the_new_families(tmp_path, arch):
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    demo = write_demo_checkpoint(tmp_path / "ckpt", arch=arch, size="tiny")
    out, cfg = _build(demo, tmp_path / "e", max_seq_len=128, kv_cache_memory="4MiB")
    assert cfg.model.family == arch
    [result] = LLMEngine.from_engine_dir(out).generate(["The quick brown fox"], SamplingParams(max_tokens=8,
                                                                                               ignore_eos=True))
    assert len(result.output_token_ids) == 8 and result.text.strip()
