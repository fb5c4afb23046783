"""The TensorRT backend: clear failures without TensorRT/GPU (CI), and a real build + run on a
GPU machine with TensorRT (skipped elsewhere, with the reason printed)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from click.testing import CliRunner

from trtforge.builder.build_config import BuildConfig
from trtforge.builder.tensorrt.build import profile_shapes
from trtforge.builder.tensorrt.onnx_export import input_names
from trtforge.cli.build import build_engine as build_engine_cmd
from trtforge.models.engine_dir import read_engine_config
from trtforge.serving.worker.trt_executor import TensorRTNetwork, TensorRTUnavailable

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()
needs_trt = pytest.mark.skipif(not HAVE_TRT, reason="needs an NVIDIA GPU and TensorRT >= 10.6")
without_trt = pytest.mark.skipif(HAVE_TRT, reason="checks the error raised where TensorRT or a "
                                                   "GPU is missing; both are present here")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", arch="qwen2", seed=2)


@without_trt
def test_build_engine_backend_tensorrt_fails_clearly_and_leaves_nothing(checkpoint, tmp_path):
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_engine_cmd, [str(checkpoint), "--output", str(out),
                                                   "--backend", "tensorrt", "--quiet"])
    assert result.exit_code != 0
    assert "--backend tensorrt" in result.output
    assert "pip install trtforge[tensorrt]" in result.output or "GPU" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no half-built temp directory either


@without_trt
def test_tensorrt_executor_load_fails_clearly(checkpoint, tmp_path):
    from trtforge.builder.build import build_engine

    engine, _ = build_engine(str(checkpoint), tmp_path / "engine",
                             BuildConfig(dtype="float32", max_seq_len=64, kv_cache_memory="1MiB"),
                             progress=False)
    with pytest.raises(TensorRTUnavailable, match=r"pip install trtforge\[tensorrt\]"):
        TensorRTNetwork.from_engine_dir(engine)


def _engine_config(max_batch_size=8, max_num_tokens=96, max_seq_len=100, block=16):
    from trtforge.builder.demo_checkpoint import hf_config
    from trtforge.builder.hf_config import model_config_from_hf
    from trtforge.builder.tokenizer_training import train_tiny_tokenizer
    from trtforge.models.engine_dir import EngineConfig

    tok = train_tiny_tokenizer(vocab_size=300)
    model = model_config_from_hf(hf_config("llama", "tiny", tok))
    build = BuildConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                        max_seq_len=max_seq_len, kv_block_size=block, kv_cache_memory="1MiB")
    return EngineConfig(model=model, build=build.to_dict(), dtype="float16")


def test_profiles_split_decode_and_prefill_over_every_input():
    cfg = _engine_config()
    decode, prefill = profile_shapes(cfg)
    assert list(decode) == list(prefill) == input_names(cfg.model.num_layers)
    assert decode["input_ids"] == ((1,), (8,), (8,))     # 1 … max_batch_size tokens
    assert prefill["input_ids"] == ((1,), (96,), (96,))  # 1 … max_num_tokens tokens
    assert prefill["query_start_loc"] == ((2,), (9,), (9,))
    width = math.ceil(100 / 16)
    assert prefill["block_tables"] == ((1, 1), (8, width), (8, width))
    # 1 MiB of fp16 KV: 2 (K, V) * 2 layers * 2 heads * 16 dims * 2 bytes = 256 B/token.
    blocks = 2**20 // (256 * 16)
    m = cfg.model
    assert decode["kv_cache_1"] == ((2, 1, 16, m.num_kv_heads, m.head_dim),
                                    (2, blocks, 16, m.num_kv_heads, m.head_dim),
                                    (2, blocks, 16, m.num_kv_heads, m.head_dim))
    for profile in (decode, prefill):
        for lo, opt, hi in profile.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))


@needs_trt
def test_tensorrt_engine_matches_torch_engine_on_gpu(checkpoint, tmp_path):
    from trtforge.builder.build import build_engine
    from trtforge.builder.tensorrt.onnx_verify import DEFAULT_STEPS, _Batcher
    from trtforge.models.loader import load_network
    from trtforge.plugins.paged_attention.metadata import AttentionMetadata

    build = dict(dtype="float16", max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                 kv_block_size=4, kv_cache_memory="1MiB")
    torch_dir, _ = build_engine(str(checkpoint), tmp_path / "torch", BuildConfig(**build),
                                progress=False)
    trt_dir, cfg = build_engine(str(checkpoint), tmp_path / "trt",
                                BuildConfig(backend="tensorrt", **build), progress=False)
    assert read_engine_config(trt_dir).versions["tensorrt"]
    assert (trt_dir / "rank0.engine").is_file() and (trt_dir / "rank0.onnx").is_file()
    reference = load_network(torch_dir, read_engine_config(torch_dir), device="cuda")
    network = TensorRTNetwork.from_engine_dir(trt_dir)
    m = cfg.model
    seqs = 1 + max(c[0] for spec in DEFAULT_STEPS for c in spec)
    shape = (2, 1 + seqs * 4, 4, m.num_kv_heads, m.head_dim)  # block 0 + 4 blocks per sequence
    pools_ref = [torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(m.num_layers)]
    pools_trt = [p.clone() for p in pools_ref]
    batcher, gen = _Batcher(4, 4), torch.Generator().manual_seed(0)
    for spec in DEFAULT_STEPS:  # includes a step that samples no row (DEFAULT_STEPS[3])
        b = {k: v.cuda() for k, v in batcher.step(spec, m.vocab_size, gen).items()}
        meta = AttentionMetadata(b["slot_mapping"], b["block_tables"], b["seq_lens"],
                                 b["query_start_loc"], max(c[1] for c in spec),
                                 int(b["seq_lens"].max()))
        with torch.no_grad():
            want = reference(b["input_ids"], b["positions"], pools_ref, meta, b["logits_indices"])
        got = network(b["input_ids"], b["positions"], pools_trt, meta, b["logits_indices"])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(pools_trt, pools_ref):  # the aliased output really updated the pools
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@needs_trt
def test_a_lone_prompt_longer_than_the_chunk_runs_on_the_tensorrt_engine(checkpoint, tmp_path):
    """Issue 28 item 1 on the GPU: the first chunks of the prompt sample no token, and the
    engine must still run them (the unpatched executor raised on the first)."""
    from trtforge.builder.build import build_engine
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    build = dict(dtype="float16", max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                 kv_block_size=4, kv_cache_memory="1MiB")
    trt_dir, _ = build_engine(str(checkpoint), tmp_path / "trt", BuildConfig(backend="tensorrt", **build),
                              progress=False)
    torch_dir, _ = build_engine(str(checkpoint), tmp_path / "torch", BuildConfig(**build), progress=False)
    prompt, params = list(range(5, 16)), SamplingParams(max_tokens=4, ignore_eos=True)
    runs = {}
    for name, engine_dir in (("trt", trt_dir), ("torch", torch_dir)):
        engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cuda"), prefill_chunk_size=4)
        runs[name] = engine.generate([prompt], params)[0].output_token_ids
    assert len(runs["trt"]) == 4
    assert runs["trt"][0] == runs["torch"][0]  # the first token follows the chunked prefill's KV


def test_plugin_module_keeps_real_annotations():
    """`tensorrt.plugin` validates @trtp.register / @trtp.impl signatures with issubclass() on
    their annotations; `from __future__ import annotations` would turn them into strings and make
    the plugin fail to register at import. Checked statically, since TensorRT is not here."""
    import ast
    from pathlib import Path

    import trtforge.plugins.paged_attention as pa

    source = Path(pa.__file__).with_name("tensorrt_plugin.py").read_text()
    future = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
              and n.module == "__future__" and any(a.name == "annotations" for a in n.names)]
    assert not future, "tensorrt_plugin.py must not use `from __future__ import annotations`"
