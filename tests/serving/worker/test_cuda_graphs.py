"""Decode steps replayed from CUDA graphs give the same tokens as eager steps.

The padding scheme (static buffers, pad rows on a reserved block) runs eagerly on CPU here; the
captured graphs themselves need a CUDA GPU (scripts/device_check.sh runs that test)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.worker.cuda_graphs import CudaGraphRunner

PROMPTS = [[5, 6, 7], list(range(10, 40)), [9] * 17, list(range(50, 55))]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cg")
    ckpt = make_checkpoint(tmp / "ckpt", "llama")
    out, _ = build_engine(str(ckpt), tmp / "engine", BuildConfig(dtype="float32", max_batch_size=8,
                          max_num_tokens=128, max_seq_len=256, kv_cache_memory="4MiB"), progress=False)
    return out


def _greedy(engine: LLMEngine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def test_padded_static_decode_matches_eager_on_cpu(engine_dir):
    expected = _greedy(LLMEngine.from_engine_dir(engine_dir))
    engine = LLMEngine.from_engine_dir(engine_dir)
    ex = engine.executor
    pad_block = ex.kv_caches[0].shape[1]  # grow each pool by the reserved pad block
    ex.kv_caches[:] = [torch.cat([kv, torch.zeros_like(kv[:, :1])], dim=1) for kv in ex.kv_caches]
    ex.graphs = CudaGraphRunner(ex.network, ex.kv_caches, (1, 2, 8), 256 // 16, pad_block, 16, capture=False)
    calls = []
    run = ex.graphs.run
    ex.graphs.run = lambda inputs: calls.append(inputs.num_tokens) or run(inputs)
    assert _greedy(engine) == expected
    assert calls and max(calls) == 4, "decode steps of 4 sequences must go through the padded path (size 8)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graph capture)")
def test_cuda_graph_decode_matches_eager_on_gpu(engine_dir):
    eager = _greedy(LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cuda")))
    graphed = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cuda", cuda_graphs=True))
    assert graphed.executor.graphs is not None and graphed.executor.graphs.graphs
    assert _greedy(graphed) == eager
