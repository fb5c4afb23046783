"""`build-engine --kv-cache-dtype int8` end to end: the KV budget buys more blocks (values and scales
counted), the engine runs more sequences at once on the same budget, the CPU decode plan writes the
same int8 KV as the network, and the logits stay close to the float32-KV engine's."""

from __future__ import annotations

import pytest
import torch

from tests.builder.quant_accuracy import all_position_logits, compare, random_sequences
from tests.helpers.checkpoints import make_checkpoint, make_variant
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.engine import LLMEngine


def _build(ckpt, out, **options) -> LLMEngine:
    opts = dict(dtype="float32", max_num_tokens=4096, max_batch_size=64, max_seq_len=128, kv_cache_memory="8MiB")
    path, _ = build_engine(str(ckpt), out, BuildConfig(**{**opts, **options}), progress=False, force=True)
    return LLMEngine.from_engine_dir(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2", num_attention_heads=8,
                           num_key_value_heads=2, tie_word_embeddings=True)  # head_dim 8


def test_budget_buys_more_blocks(ckpt, tmp_path):
    budget = 81920
    f32 = _build(ckpt, tmp_path / "f32", kv_cache_memory=str(budget))
    i8 = _build(ckpt, tmp_path / "i8", kv_cache_memory=str(budget), kv_cache_dtype="int8")
    m = i8.engine_config.model
    assert i8.engine_config.build["kv_cache_dtype"] == "int8" and i8.engine_config.kv_cache_dtype == "int8"
    assert f32.engine_config.kv_cache_dtype == "float32"
    per_token = 2 * m.num_layers * m.num_kv_heads * (m.head_dim + 4)
    assert i8.engine_config.report["kv_bytes_per_token"] == per_token
    blocks_f32, blocks_i8 = (e.scheduler_config.num_blocks for e in (f32, i8))
    assert blocks_f32 == f32.engine_config.report["kv_num_blocks"] == budget // (kv_bytes_per_token(m, "float32") * 16)
    assert blocks_i8 == i8.engine_config.report["kv_num_blocks"] == budget // (per_token * 16)
    assert blocks_i8 >= 2 * blocks_f32
    ex = i8.executor
    assert ex.kv_caches[0].dtype == torch.int8 and ex.kv_caches[0].shape[1] == blocks_i8
    assert ex.kv_scales[0].dtype == torch.float32 and list(ex.kv_scales[0].shape) == list(ex.kv_caches[0].shape[:4])
    allocated = sum(t.numel() * t.element_size() for t in ex.kv_caches + ex.kv_scales)
    assert allocated <= budget < allocated + per_token * 16  # the budget, to within one block


def _peak_running(engine: LLMEngine, n: int) -> int:
    for seq in random_sequences(500, n, 20, seed=1):
        engine.add_request(seq, SamplingParams(max_tokens=12, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.scheduler.num_running)
    return peak


def test_int8_kv_at_least_doubles_concurrent_sequences(ckpt, tmp_path):
    """Same KV budget (10 float32 blocks), 24 requests of 32 tokens (2 blocks) each."""
    budget = 10 * 16 * kv_bytes_per_token(make_engine_cfg(ckpt, tmp_path).model, "float32")
    f32 = _build(ckpt, tmp_path / "f32", kv_cache_memory=str(budget))
    i8 = _build(ckpt, tmp_path / "i8", kv_cache_memory=str(budget), kv_cache_dtype="int8")
    peaks = {name: _peak_running(e, 24) for name, e in (("float32", f32), ("int8", i8))}
    print(peaks, f32.scheduler_config.num_blocks, i8.scheduler_config.num_blocks)
    assert peaks["float32"] <= 5  # 10 blocks / 2 per sequence
    assert peaks["int8"] >= 2 * peaks["float32"]


def make_engine_cfg(ckpt, tmp_path):
    return _build(ckpt, tmp_path / "probe", kv_cache_memory="1MiB").engine_config


def test_logits_close_to_float_kv(ckpt, tmp_path):
    """Teacher-forced over 4 x 100 positions (prefill path) and greedy generation (the C decode
    kernel): int8 KV against float32 KV of the same float32 weights."""
    f32 = _build(ckpt, tmp_path / "f32")
    i8 = _build(ckpt, tmp_path / "i8", kv_cache_dtype="int8")
    seqs = random_sequences(500, 4, 100)
    with torch.inference_mode():
        got = compare(all_position_logits(f32, seqs), all_position_logits(i8, seqs))
    prompts = random_sequences(500, 4, 8, seed=2)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    a = [o.output_token_ids for o in f32.generate(prompts, params)]
    b = [o.output_token_ids for o in i8.generate(prompts, params)]
    first_diff = [next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
    print(got, "greedy tokens equal before the first difference:", first_diff)
    assert got["positions"] == 400
    # An int8 step moves each K/V element by at most 1/254 of its row's max: logits move by
    # ~1e-3 relative, so the next-token distributions barely change.
    assert got["mean_kl"] < 1e-3
    assert got["top1_agreement"] >= 0.97
    assert sum(first_diff) >= 0.5 * 4 * 64


def test_decode_plan_runs_int8_kv(tmp_path, monkeypatch):
    ckpt = make_variant(tmp_path / "ckpt", "llama-gqa-llama3rope")
    engine = _build(ckpt, tmp_path / "i8", kv_cache_dtype="int8")
    ex = engine.executor
    assert ex.cpu_plan is not None and ex.cpu_plan.kv_scales is ex.kv_scales
    seen, real = [], ex.execute

    def both(inputs):
        if not ex.cpu_plan.can_run(inputs):
            return real(inputs)
        pools = ex.kv_caches + ex.kv_scales
        before = [t.clone() for t in pools]
        with torch.inference_mode():
            planned = ex.cpu_plan.run(inputs)
            written = [t.clone() for t in pools]
            for t, b in zip(pools, before):
                t.copy_(b)
            reference = ex.network(inputs.input_ids, inputs.positions, ex.kv_caches, inputs.meta,
                                   inputs.logits_indices, kv_scales=ex.kv_scales)
        torch.testing.assert_close(planned, reference, atol=1e-5, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(written, pools)), "the plan wrote other KV"
        seen.append(inputs.num_tokens)
        return planned

    monkeypatch.setattr(ex, "execute", both)
    engine.generate([[5, 9, 13, 200, 7], list(range(20, 57))], SamplingParams(max_tokens=5, ignore_eos=True))
    assert seen.count(2) >= 3, seen


def test_refused_where_unsupported(ckpt, tmp_path):
    for backend in ("tensorrt", "trtllm"):
        with pytest.raises(BuildError, match="kv-cache-dtype int8 is not supported with --backend"):
            BuildConfig(backend=backend, kv_cache_dtype="int8").check_kv_cache_dtype()
    with pytest.raises(BuildError, match="unknown"):
        BuildConfig(kv_cache_dtype="fp8").check_kv_cache_dtype()
    from trtforge.serving.worker.executor import NetworkExecutor

    cfg = _build(ckpt, tmp_path / "i8", kv_cache_dtype="int8").engine_config
    with pytest.raises(ValueError, match="--device cpu"):
        NetworkExecutor(None, cfg, 4, "meta")


def test_validate_checks_kv_cache_dtype():
    with pytest.raises(BuildError, match="--tp-size 2 is not supported yet"):
        BuildConfig(kv_cache_dtype="int8", tp_size=2).validate(128, None)
    with pytest.raises(BuildError, match="unknown"):
        BuildConfig(kv_cache_dtype="int4").validate(128, None)
