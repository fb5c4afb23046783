"""A step that samples no token (a prefill chunk short of its prompt's end) on the TensorRT path:
the plan's profiles take no empty logits_indices, so the step asks for one row and returns none.

Run on CPU through the TensorRT executor's sibling (serving/worker/trt_ort.py): the real ONNX
export under ONNX Runtime, prepared by the same step code as the GPU path and refused the shapes
TensorRT's optimisation profiles refuse. TensorRT itself is not here; the GPU checks are in
test_tensorrt_backend.py."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from trtforge.builder.tensorrt.build import profile_shapes
from trtforge.builder.tensorrt.onnx_export import META_INPUTS
from trtforge.cli.onnx import export_onnx_cmd
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.scheduler import SchedulerConfig
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.tokenizer import load_tokenizer
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.engine import LLMEngine, num_kv_blocks
from trtforge.serving.worker.network_executor import NetworkExecutor
from trtforge.serving.worker.trt_ort import OnnxRuntimePlan
from trtforge.serving.worker.trt_step import META, check_in_profile, plan_step

ARCH = "llama"
CHUNK = 4


@pytest.fixture(scope="module")
def plan_dir(engine_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("zero-row-onnx")
    result = CliRunner().invoke(export_onnx_cmd, [str(engine_dirs[ARCH]), str(out)])
    assert result.exit_code == 0, result.output
    return out


def _one_chunk(num_new: int, samples: bool):
    """A lone prompt's first chunk of `num_new` tokens in block 1 (block size 4)."""
    ids = torch.arange(3, 3 + num_new)
    pos = torch.arange(num_new)
    blocks = -(-num_new // 4)
    table = torch.arange(1, 1 + blocks, dtype=torch.int32)[None]
    slots = table[0].repeat_interleave(4)[:num_new].long() * 4 + pos % 4
    meta = AttentionMetadata(slots, table, torch.tensor([num_new], dtype=torch.int32),
                             torch.tensor([0, num_new], dtype=torch.int32), num_new, num_new)
    rows = torch.tensor([num_new - 1]) if samples else torch.zeros(0, dtype=torch.int64)
    return ids, pos, meta, rows


def test_the_step_code_feeds_the_graphs_inputs():
    assert META == META_INPUTS


def test_a_step_without_rows_asks_the_plan_for_one_and_keeps_none():
    ids, pos, meta, rows = _one_chunk(6, samples=False)
    step = plan_step(ids, pos, meta, rows, torch.device("cpu"), decode_max_tokens=4, max_num_tokens=64)
    assert step.rows == 0 and step.profile == 1  # 6 tokens > max_batch_size 4: the prefill profile
    assert step.feeds["logits_indices"].tolist() == [5]  # the step's last token
    ids, pos, meta, rows = _one_chunk(3, samples=True)
    step = plan_step(ids, pos, meta, rows, torch.device("cpu"), 4, 64)
    assert (step.rows, step.profile, step.feeds["logits_indices"].tolist()) == (1, 0, [2])


def test_the_profiles_refuse_an_empty_logits_indices(engine_dirs):
    """What TensorRT's set_input_shape said to the unpatched step: the cause of the bug."""
    for profile in profile_shapes(read_engine_config(engine_dirs[ARCH])):
        with pytest.raises(ValueError, match="input logits_indices of shape \\(0,\\) is outside"):
            check_in_profile(profile, "logits_indices", (0,))
        check_in_profile(profile, "logits_indices", (1,))
        with pytest.raises(ValueError, match="outside"):
            check_in_profile(profile, "input_ids", (65,))  # over max_num_tokens


def test_a_zero_row_step_runs_on_the_exported_graph_and_writes_its_kv(engine_dirs, plan_dir):
    cfg = read_engine_config(engine_dirs[ARCH])
    plan = OnnxRuntimePlan(plan_dir / "rank0.onnx", cfg)
    m = cfg.model
    pools = [torch.zeros(2, 8, 4, m.num_kv_heads, m.head_dim) for _ in range(m.num_layers)]
    logits = plan(*_one_chunk(6, samples=False)[:2], pools, *_one_chunk(6, samples=False)[2:])
    assert logits.shape == (0, m.vocab_size)
    assert all(p[:, 1:3].abs().sum() > 0 for p in pools)  # blocks 1 and 2 hold the chunk's KV
    assert all(p[:, 3:].abs().sum() == 0 and p[:, 0].abs().sum() == 0 for p in pools)


def _engine(engine_dir, network=None) -> LLMEngine:
    cfg = read_engine_config(engine_dir)
    if network is None:
        return LLMEngine.from_engine_dir(engine_dir, prefill_chunk_size=CHUNK)
    blocks = num_kv_blocks(cfg, None)
    sched = SchedulerConfig.for_engine(cfg.build, cfg.scheduling, blocks, {"prefill_chunk_size": CHUNK})
    return LLMEngine(cfg, RuntimeConfig(), NetworkExecutor(network, cfg, blocks, "cpu"),
                     load_tokenizer(engine_dir), sched)


def test_a_lone_prompt_longer_than_the_chunk_generates_through_the_plan(engine_dirs, plan_dir):
    """The issue's case: one prompt of 11 tokens, prefill_chunk_size 4. Its first two steps sample
    nothing; the unpatched executor refused the first. Tokens must equal the torch engine's."""
    engine_dir = engine_dirs[ARCH]
    plan = OnnxRuntimePlan(plan_dir / "rank0.onnx", read_engine_config(engine_dir))
    prompt = list(range(5, 16))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    got = _engine(engine_dir, plan).generate([prompt], params)[0]
    want = _engine(engine_dir).generate([prompt], params)[0]
    assert got.output_token_ids == want.output_token_ids and len(got.output_token_ids) == 3
    # 3 prefill steps (4 + 4 + 3 tokens; the first two sample no row) + 2 decode steps.
    assert plan.steps_run == 5
