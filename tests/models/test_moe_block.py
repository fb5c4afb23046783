"""models/moe.py on its own: the grouped fast path equals the every-expert reference, calls only the experts
some token chose (so a decode step reads only theirs), and routes as transformers' routers define."""

from __future__ import annotations

import pytest
import torch

from trtforge.models.layers import Layers
from trtforge.models.model_config import ModelConfig
from trtforge.models.moe import SparseMoE, route
from trtforge.plugins import kernels


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(architecture="MixtralForCausalLM", family="mixtral", vocab_size=97, hidden_size=48,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=40, norm="rms",
                       norm_eps=1e-6, activation="silu", gated_mlp=True, position="rope",
                       max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=False, **{"num_experts": 8, "num_experts_per_tok": 2,
                                                          "moe_intermediate_size": 40, **moe})


def _block(cfg: ModelConfig, layers: Layers | None = None) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(cfg, layers or Layers())
    with torch.no_grad():
        for t in block.state_dict().values():  # parameters, and CpuLinear's weights (buffers)
            t.normal_(0, 0.3)
    for module in block.modules():  # the CPU kernels' layout, as the loader does
        if hasattr(module, "pack_weights"):
            module.pack_weights()
    return block.eval()


CASES = {"mixtral": {}, "not renormalised": {"norm_topk_prob": False},
         "shared expert": {"norm_topk_prob": False, "shared_expert_intermediate_size": 24},
         "top-3 of 16": {"num_experts": 16, "num_experts_per_tok": 3}}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layers", ["torch", "cpu kernels"])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_grouped_path_equals_the_reference(case, layers, tokens):
    cfg = _cfg(**CASES[case])
    block = _block(cfg, Layers() if layers == "torch" else Layers.for_engine(_Engine(cfg), "cpu", "auto"))
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        torch.testing.assert_close(block(x), block.forward_reference(x), atol=2e-6, rtol=1e-5)


class _Engine:
    """The fields Layers.for_engine reads of an EngineConfig."""

    def __init__(self, cfg: ModelConfig):
        self.model, self.dtype, self.quantization = cfg, "float32", None


def test_only_the_chosen_experts_run():
    cfg = _cfg(num_experts=16, num_experts_per_tok=2)
    block = _block(cfg)
    called: list[int] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda _m, _a, _o, e=e: called.append(e))
    for tokens in (1, 3):  # a decode step of one and of three sequences
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(10 + tokens))
        called.clear()
        with torch.inference_mode():
            block(x)
            chosen = route(block.router(x), 2, True)[1]
        assert sorted(called) == sorted(set(chosen.flatten().tolist()))  # each chosen expert once, no other
        assert len(called) <= 2 * tokens < 16


def test_route_is_transformers_router():
    """Softmax in float32, top-k, renormalised or not: Mixtral's and Qwen2-MoE's own routers as the oracle."""
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(3))
    for router, normalize in ((MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=6)), True),
                              (Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2,
                                                                 norm_topk_prob=False)), False)):
        torch.nn.init.normal_(router.weight)
        logits, weights, ids = router(x)
        ours = route(logits, 2, normalize)
        assert torch.equal(ours[1], ids) and torch.allclose(ours[0], weights.float())


def test_kernels_choice_builds_cpu_linears_for_the_experts():
    with kernels.override(linear="cpu"):
        block = SparseMoE(_cfg(), Layers.for_engine(_Engine(_cfg()), "cpu", "auto"))
    from trtforge.plugins.cpu.linear import CpuLinear

    assert isinstance(block.router, CpuLinear) and isinstance(block.experts[3].gate_up, CpuLinear)
