"""models/mlp.py on CPU kernels: the gate/up product and the SiLU·mul go into a thread's reused scratch
buffers (plugins/cpu/workspace.py) — the same result as the torch layers, the same buffers call after
call, and nothing the MLP returns aliases them."""

from __future__ import annotations

import dataclasses
import threading

import torch

from trtforge.models.layers import Layers
from trtforge.models.mlp import MLP
from trtforge.models.model_config import ModelConfig
from trtforge.plugins.cpu import quant_linear as ql, workspace


def _cfg() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=97, hidden_size=48,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=40, norm="rms",
                       norm_eps=1e-6, activation="silu", gated_mlp=True, position="rope",
                       max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=False)


class _Engine:
    def __init__(self, cfg):
        self.model, self.dtype, self.quantization = cfg, "float32", None


def _mlps() -> tuple[MLP, MLP]:
    """(on the CPU kernels, packed; on plain torch layers), the same weights."""
    cfg = _cfg()
    fast, ref = MLP(cfg, Layers.for_engine(_Engine(cfg), "cpu", "auto")), MLP(cfg, Layers())
    torch.manual_seed(0)
    with torch.no_grad():
        for t in ref.state_dict().values():
            t.normal_(0, 0.3)
    fast.load_state_dict(ref.state_dict())
    for module in fast.modules():
        if hasattr(module, "pack_weights"):
            module.pack_weights()
    return fast.eval(), ref.eval()


def _buffers() -> dict:
    return dict(getattr(workspace._local, "buffers", {}))


def test_mlp_reuses_its_scratch_and_returns_fresh_outputs():
    fast, ref = _mlps()
    assert fast.reuse_gate_up and fast.fused_silu, "the CPU kernels' MLP writes into the workspace"
    workspace.clear()
    xs = [torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)) for rows in (130, 7, 130)]
    with torch.inference_mode():
        outs = [fast(x) for x in xs]
        after_first = {k: v.data_ptr() for k, v in _buffers().items()}
        refs = [ref(x) for x in xs]
    assert {k[0] for k in after_first} == {"mlp.gate_up", "mlp.act"}
    for got, want in zip(outs, refs):  # earlier outputs intact: the scratch was overwritten since
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert {k: v.data_ptr() for k, v in _buffers().items()} == after_first, "no new buffer for smaller or equal calls"
    scratch_ptrs = set(after_first.values())
    assert not any(o.data_ptr() in scratch_ptrs for o in outs), "an output lives in a scratch buffer"


def test_scratch_is_per_thread_and_grows():
    like = torch.empty(0)
    workspace.clear()
    small = workspace.scratch("t", (4, 8), like)
    assert workspace.scratch("t", (2, 8), like).data_ptr() == small.data_ptr()
    big = workspace.scratch("t", (64, 8), like)
    assert big.shape == (64, 8) and big.is_contiguous()
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(workspace.scratch("t", (64, 8), like).data_ptr()))
    thread.start()
    thread.join()
    assert other[0] != big.data_ptr(), "another thread must get its own buffer"


def test_autograd_and_tracing_bypass_the_workspace():
    """Outside eager inference (autograd here) the MLP neither reads nor fills the workspace."""
    fast, ref = _mlps()
    workspace.clear()
    x = torch.randn(5, 48, requires_grad=True)
    torch.testing.assert_close(fast(x), ref(x), atol=2e-6, rtol=1e-5)
    assert _buffers() == {}


def test_quantized_mlp_writes_gate_up_into_the_workspace():
    """An int8_wo engine's MLP (int8-activation C kernels, VNNI-packed where the CPU has it) writes its
    gate/up product into the workspace too: equal to the same layers on the reference path, buffers
    reused, outputs fresh."""
    cfg = dataclasses.replace(_cfg(), hidden_size=64, intermediate_size=96, head_dim=16)
    engine = _Engine(cfg)
    engine.quantization = {"scheme": "int8_wo"}
    fast, ref = MLP(cfg, Layers.for_engine(engine, "cpu", "auto")), MLP(cfg, Layers.for_engine(engine, "cpu"))
    torch.manual_seed(0)
    state = {k: (torch.randint(-127, 128, v.shape, dtype=torch.int8) if v.dtype == torch.int8
                 else torch.rand(v.shape) * 0.01 + 0.001) for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    fast.load_state_dict(state)
    for module in fast.modules():
        if hasattr(module, "pack_weights"):
            module.pack_weights()
    assert fast.reuse_gate_up and fast.gate_up.c_kernels and fast.gate_up.a8, "int8-activation C kernels"
    workspace.clear()
    # rows quantised per block of 32 on both sides: the reference's arithmetic is gemv_a8_reference's
    xs = [torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) for rows in (70, 3, 70)]
    with torch.inference_mode():
        outs = [fast(x) for x in xs]
        buffers = {k: v.data_ptr() for k, v in _buffers().items()}
        again = fast(xs[0])
    assert {k[0] for k in buffers} == {"mlp.gate_up", "mlp.act"}
    assert {k: v.data_ptr() for k, v in _buffers().items()} == buffers, "the same buffers on the next call"
    assert not any(o.data_ptr() in set(buffers.values()) for o in outs)
    torch.testing.assert_close(again, outs[0], atol=0, rtol=0)
    def a8(layer, x):  # the int8-activation kernels' arithmetic (float64 reference), on ref's codes
        return ql.gemv_a8_reference(x, layer.qweight, layer.scales, layer.bias, "int8_wo", 0)[0].float()

    with torch.inference_mode():
        for x, got in zip(xs, outs):
            gate, up = a8(ref.gate_up, x).chunk(2, dim=-1)
            want = a8(ref.down, torch.nn.functional.silu(gate) * up)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
