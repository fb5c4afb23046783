"""The kernels registry (plugins/kernels.py): its table, the environment and overrides over it, and
the network built from its choice (models/layers.py) holding those kernels from construction on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trtforge.plugins import kernels
from trtforge.plugins.paged_attention import cpu, op, reference


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch):
    for var in (kernels.ATTENTION_ENV, kernels.ONEDNN_ENV, kernels.QUANT_ACTIVATIONS_ENV):
        monkeypatch.delenv(var, raising=False)


def test_isa_is_one_the_table_knows():
    assert kernels.detect_isa() in kernels.ISAS


def test_table_rows_most_specific_first():
    for isa in kernels.ISAS:
        assert kernels.lookup("linear", "cpu", torch.float32, isa) == "cpu"
    assert kernels.lookup("linear", "cpu", torch.bfloat16, "avx2") == "torch"
    assert kernels.lookup("linear", "cuda", torch.float32) == "torch"
    assert kernels.lookup("attention", "cuda", torch.float16) == ("triton", "cpu")
    assert kernels.lookup("attention", "cpu", torch.float32, "portable") == ("cpu",)


def test_choose_cpu_float32_and_the_environment(monkeypatch):
    fast = kernels.choose("cpu", torch.float32)
    assert (fast.linear, fast.quant_linear, fast.fused_ops, fast.quant_activations, fast.attention) == \
        ("cpu", "cpu", "cpu", "int8", ("cpu",))
    assert fast.isa == kernels.detect_isa() and fast.isa in fast.describe()
    other = kernels.choose("cpu", torch.bfloat16)
    assert (other.linear, other.quant_linear, other.fused_ops) == ("torch", "torch", "torch")
    monkeypatch.setenv(kernels.ONEDNN_ENV, "0")
    monkeypatch.setenv(kernels.QUANT_ACTIVATIONS_ENV, "float")
    monkeypatch.setenv(kernels.ATTENTION_ENV, "reference")
    env = kernels.choose("cpu", torch.float32)
    assert (env.linear, env.quant_activations, env.attention) == ("torch", "float", ("reference",))
    with kernels.override(linear="cpu", attention="auto"):  # the explicit choice beats the environment
        forced = kernels.choose("cpu", torch.float32)
        assert forced.linear == "cpu" and forced.attention == ("cpu",)
    assert kernels.choose("cpu", torch.float32).linear == "torch"  # the override ended with its block


def test_override_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown kernel op 'matmul'"):
        with kernels.override(matmul="cpu"):
            pass
    with pytest.raises(ValueError, match="unknown linear implementation 'fast'"):
        with kernels.override(linear="fast"):
            pass


def test_attention_impl_follows_the_preference():
    impl = op.attention_impl(("cpu",), torch.device("cpu"))
    assert impl.function() is cpu.paged_attention and impl.function(int8_kv=True) is cpu.paged_attention
    assert op.attention_impl(("reference",), torch.device("cpu")).function() is reference.paged_attention
    # auto on a CPU device: Triton is skipped for the next preference, whether or not it imports
    assert op.attention_impl(("triton", "cpu"), torch.device("cpu")).name == "cpu"


def test_the_network_is_built_with_the_choice(tmp_path, monkeypatch):
    """load_network(kernels="auto") builds CpuLinear layers, the fused ops and the resolved attention
    into the network; the default ("reference") plain torch layers, as export traces them."""
    from tests.helpers.checkpoints import make_variant
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig
    from trtforge.models.layers import TiedLMHead
    from trtforge.models.loader import load_network
    from trtforge.plugins.cpu.linear import CpuLinear, PackedEmbedding, cpu_linear

    ckpt = make_variant(tmp_path / "ckpt", "qwen2-gqa-bias-tied")
    out, cfg = build_engine(str(ckpt), tmp_path / "e", BuildConfig(dtype="float32", kv_cache_memory="8MiB"),
                            progress=False)
    fast = load_network(out, cfg, kernels="auto")
    assert isinstance(fast.layers[0].attn.qkv, CpuLinear) and isinstance(fast.layers[0].mlp.down, CpuLinear)
    assert isinstance(fast.head, TiedLMHead) and fast.head.kernel is cpu_linear
    # packed at load: no dense copy left, and the tied table held once (the embeddings read the packed head)
    assert fast.layers[0].attn.qkv.weight is None and fast.layers[0].attn.qkv.packed is not None
    assert isinstance(fast.embed_tokens, PackedEmbedding) and fast.embed_tokens._head[0] is fast.head
    assert fast.head._embedding[0].weight is None and fast.head.packed is not None
    assert fast.layers[0].input_norm.fused and fast.layers[0].attn.paged_attention.name == "cpu"
    plain = load_network(out, cfg)
    assert type(plain.layers[0].attn.qkv) is nn.Linear and plain.head.kernel is torch.nn.functional.linear
    assert not plain.layers[0].input_norm.fused and plain.layers[0].attn.paged_attention is None
    packed_away = {k for k in plain.state_dict() if k.endswith(".weight") and k not in fast.state_dict()}
    assert fast.state_dict().keys() == plain.state_dict().keys() - packed_away
    assert "embed_tokens.weight" in packed_away and "layers.0.attn.qkv.weight" in packed_away
    with torch.inference_mode():
        ids = torch.tensor([3, 5, 7])
        torch.testing.assert_close(fast.head(fast.embed_tokens(ids)), plain.head(plain.embed_tokens(ids)),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kernels='fast'"):
        load_network(out, cfg, kernels="fast")
