"""Mixture-of-Experts with --tp-size 2: every expert's gate/up rows and down columns (and the shared expert's)
split across the ranks, the router replicated; on two real gloo ranks the engine gives the tp-1 engine's
greedy tokens and transformers' logits (Mixtral; Qwen2-MoE with its shared expert and a dense layer)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.builder.moe_checkpoints import make_moe_checkpoint
from tests.builder.test_parity import _prompt_logits, _prompts
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def _build(ckpt, out, tp: int):
    return build_engine(str(ckpt), out, BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=256,
                                                    kv_cache_memory="16MiB", tp_size=tp), progress=False)[0]


def test_expert_shards_reassemble_the_single_rank_weights(tmp_path):
    ckpt = make_moe_checkpoint(tmp_path / "ckpt", "qwen2_moe")
    tp1, tp2 = _build(ckpt, tmp_path / "tp1", 1), _build(ckpt, tmp_path / "tp2", 2)
    full = load_file(tp1 / "rank0.safetensors")
    ranks = [load_file(tp2 / f"rank{r}.safetensors") for r in range(2)]
    for name, width in (("layers.2.mlp.experts.5", 40), ("layers.0.mlp.shared_expert", 56)):
        gate_up, half = full[f"{name}.gate_up.weight"], width // 2
        for r, shard in enumerate(ranks):  # rank r: its half of the gate rows, then of the up rows
            rows = torch.cat([gate_up[r * half:(r + 1) * half], gate_up[width + r * half:width + (r + 1) * half]])
            assert torch.equal(shard[f"{name}.gate_up.weight"], rows)
        assert torch.equal(torch.cat([s[f"{name}.down.weight"] for s in ranks], 1), full[f"{name}.down.weight"])
    for name in ("layers.0.mlp.router.weight", "layers.0.mlp.shared_expert_gate.weight"):
        assert all(torch.equal(s[name], full[name]) for s in ranks)  # replicated
    mapping = json.loads((tp2 / "engine.json").read_text())["tensor_parallel"]
    assert [r["expert_intermediate"] for r in mapping["ranks"]] == [[0, 20], [20, 40]]
    assert [r["shared_expert_intermediate"] for r in mapping["ranks"]] == [[0, 28], [28, 56]]


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_tp2_matches_tp1_and_transformers(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    ckpt = make_moe_checkpoint(tmp_path / "ckpt", variant)
    tp1 = LLMEngine.from_engine_dir(_build(ckpt, tmp_path / "tp1", 1))
    tp2 = LLMEngine.from_engine_dir(_build(ckpt, tmp_path / "tp2", 2))
    try:
        prompts = _prompts(tp1.engine_config.model.vocab_size)[:3]
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        for p, b in zip(prompts, _prompt_logits(tp2, prompts)):
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0]
            assert (b - ref).abs().max().item() < 1e-4, f"{variant}: tp2 logits differ from transformers'"
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        want = [o.output_token_ids for o in tp1.generate(prompts, params)]
        assert [o.output_token_ids for o in tp2.generate(prompts, params)] == want
    finally:
        tp2.executor.close()


def test_expert_width_that_does_not_split_is_refused(tmp_path):
    ckpt = make_moe_checkpoint(tmp_path / "ckpt", "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(BuildError, match="does not divide the MoE experts' intermediate size"):
        _build(ckpt, tmp_path / "e", 2)
    assert not (tmp_path / "e").exists()
