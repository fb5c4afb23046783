"""`build-engine --backend trtllm`: the option mapping (pure), the clear failure without
TensorRT-LLM (CI), and a real build + emit where TensorRT-LLM and a GPU are (skipped elsewhere,
with the reason printed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

from trtforge.builder.build_config import BACKENDS, BuildConfig
from trtforge.builder.trtllm.options import trtllm_build_options
from trtforge.builder.trtllm.versions import TARGET
from trtforge.cli.build import build_engine as build_engine_cmd
from trtforge.models.errors import BuildError

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
_MISSING = [what for what, here in (("tensorrt_llm", HAVE_TRTLLM),
                                    ("a CUDA GPU", torch.cuda.is_available())) if not here]
needs_trtllm = pytest.mark.skipif(bool(_MISSING), reason=f"needs tensorrt_llm and an NVIDIA GPU "
                                  f"(the NGC image {TARGET.image}); missing here: "
                                  f"{' and '.join(_MISSING)}")
without_trtllm = pytest.mark.skipif(HAVE_TRTLLM, reason="checks the error raised where "
                                                        "tensorrt_llm is missing; it is installed here")


def _build(**kw) -> BuildConfig:
    b = BuildConfig(backend="trtllm", dtype="float16", max_batch_size=8, max_num_tokens=256,
                    kv_block_size=32, **kw)
    return b.validate(max_position_embeddings=2048, sliding_window=None)


def test_our_limits_map_onto_tensorrt_llms_options():
    o = trtllm_build_options(_build(max_seq_len=1024), "float16", kv_tokens=4096)
    assert o.build_config_kwargs() == {"max_batch_size": 8, "max_num_tokens": 256,
                                       "max_seq_len": 1024, "max_input_len": 1023,
                                       "max_beam_width": 1}
    assert o.plugin == {"paged_kv_cache": True, "remove_input_padding": True,
                        "context_fmha": True, "use_paged_context_fmha": True,
                        "tokens_per_block": 32}
    assert (o.dtype, o.kv_cache_max_tokens) == ("float16", 4096)
    assert trtllm_build_options(_build(), "bfloat16", 1).max_seq_len == 2048  # the model's


@pytest.mark.parametrize("kw, dtype, match", [
    ({"kv_block_size": 24}, "float16", "not a power of 2"),
    ({}, "float8", "not one TensorRT-LLM builds"),
])
def test_what_tensorrt_llm_cannot_build_is_refused(kw, dtype, match):
    b = BuildConfig(backend="trtllm", max_num_tokens=256, **kw).validate(2048, None)
    with pytest.raises(BuildError, match=match):
        trtllm_build_options(b, dtype, 1)


def test_trtllm_is_a_backend_choice():
    assert "trtllm" in BACKENDS
    result = CliRunner().invoke(build_engine_cmd, ["--help"])
    assert "trtllm" in result.output


@without_trtllm
def test_without_tensorrt_llm_the_build_stops_at_once(tmp_path):
    """Before anything is read or converted: the checkpoint does not even exist."""
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_engine_cmd, [str(tmp_path / "no-such-checkpoint"), "--output",
                                                   str(out), "--backend", "trtllm", "--quiet"])
    assert result.exit_code != 0
    assert "--backend trtllm" in result.output and "TensorRT-LLM" in result.output
    assert TARGET.image in result.output and "25.05-trtllm-python-py3" in result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # no engine, no half-built temp directory


@needs_trtllm
def test_build_and_emit_with_tensorrt_llm(tmp_path):
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint
    from trtforge.model_repo.emit import emit_repo
    from trtforge.model_repo.pbtxt import read_config

    ckpt = write_demo_checkpoint(tmp_path / "ckpt", arch="llama", seed=3, dtype="float16")
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_engine_cmd, [str(ckpt), "--output", str(out), "--backend",
                                                   "trtllm", "--dtype", "float16", "--max-seq-len",
                                                   "128", "--kv-cache-memory", "16MiB", "--quiet"])
    assert result.exit_code == 0, result.output
    engine = json.loads((out / "engine.json").read_text())
    assert engine["backend"] == "trtllm"
    import tensorrt
    import tensorrt_llm

    assert engine["versions"]["tensorrt_llm"] == tensorrt_llm.__version__
    assert engine["versions"]["tensorrt"] == tensorrt.__version__
    assert {"rank0.engine", "config.json", "tokenizer.json"} <= set(engine["files"])
    assert "rank0.safetensors" not in engine["files"]
    trt_config = json.loads((out / "config.json").read_text())["build_config"]
    assert trt_config["plugin_config"]["tokens_per_block"] == 16
    assert trt_config["plugin_config"]["use_paged_context_fmha"]
    repo = emit_repo(out, tmp_path / "repo")
    assert read_config(repo / "tensorrt_llm" / "config.pbtxt").backend == "tensorrtllm"


def test_an_installed_tensorrt_llm_without_a_record_stops_the_build(monkeypatch, caplog):
    """The check require_tensorrt_llm runs on the imported module's version (pure: no TensorRT-LLM)."""
    from trtforge.builder.trtllm.build import check_installed_version
    from trtforge.builder.trtllm.versions import ALLOW_DRIFT_ENV, RELEASES

    monkeypatch.delenv(ALLOW_DRIFT_ENV, raising=False)
    assert check_installed_version("0.19.0") is RELEASES["0.19.0"]
    assert check_installed_version("1.2.0rc8") is RELEASES["1.2.0rc8"]
    with pytest.raises(BuildError, match="the installed TensorRT-LLM 1.1.0 has no recorded Triton") as err:
        check_installed_version("1.1.0")
    assert ALLOW_DRIFT_ENV in str(err.value) and "min_tokens/seed" in str(err.value)
    monkeypatch.setenv(ALLOW_DRIFT_ENV, "1")
    with caplog.at_level("WARNING"):
        assert check_installed_version("1.1.0") is RELEASES["1.2.0rc8"]
    assert "1.1.0 is installed, which trtforge has no record of" in caplog.text
