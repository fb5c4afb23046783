"""The LLM-API repository (TrtllmOptions(repo="llmapi")): TensorRT-LLM's all_models/llmapi model for a
Hugging Face checkpoint, no engine built. The config against each release's record, model.yaml's
LLM arguments from our options, the model files, and what `trtforge serve` checks."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.model_repo.trtllm.conftest import RELEASE_VERSIONS, fake_models_dir, record_of
from trtforge.builder.trtllm.versions import TrtllmDrift
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.trtllm import llmapi
from trtforge.model_repo.trtllm.serve_check import check_trtllm_repo
from trtforge.model_repo.trtllm.templates import facts_of
from trtforge.model_repo.trtllm.values import TrtllmOptions as T


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", arch="qwen2", seed=3)


def _yaml(repo) -> dict:
    return yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())


@pytest.mark.parametrize("version", RELEASE_VERSIONS)
def test_the_config_is_the_releases_llmapi_interface(checkpoint, tmp_path, version):
    repo = emit_repo(checkpoint, tmp_path / "repo", trtllm_models_dir=T(repo="llmapi", version=version))
    assert sorted(p.name for p in repo.iterdir()) == ["tensorrt_llm"]
    config = read_config(repo / "tensorrt_llm" / "config.pbtxt")
    record = record_of(version)["llmapi"]["tensorrt_llm"]
    facts = facts_of(config)
    assert (config.backend, config.max_batch_size) == ("python", 0)  # batching: model.yaml's
    assert [t.as_list() for t in facts.inputs] == record["inputs"]
    assert [t.as_list() for t in facts.outputs] == record["outputs"]
    assert facts.parameters == record["parameters"] == []
    args = _yaml(repo)
    assert set(record["model_yaml"]["keys"]) <= set(args)
    assert set(record["model_yaml"]["triton_config_keys"]) == set(args["triton_config"])
    names = {i.name for i in config.input}
    if version == "0.19.0":
        assert "sampling_param_beam_width" in names and "pytorch_backend_config" in args
    else:
        assert {"sampling_param_best_of", "stop"} <= names and "pytorch_backend_config" not in args
        assert "kv_cache_hit_rate" in {o.name for o in config.output}


def test_model_yaml_carries_our_options(checkpoint, tmp_path):
    repo = emit_repo(checkpoint, tmp_path / "repo", trtllm_models_dir=T(repo="llmapi", version="1.2.0rc8"),
                     policy="guaranteed_no_evict", enable_prefix_caching=False, prefill_chunk_size=0,
                     kv_cache_memory="1MiB", max_batch_size=4)
    args = _yaml(repo)
    assert args["model"] == str(checkpoint.resolve()) and args["backend"] == "pytorch"
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert args["kv_cache_config"]["enable_block_reuse"] is False
    assert args["enable_chunked_prefill"] is False and args["max_batch_size"] == 4
    # qwen2 tiny, float32 (the checkpoint's dtype): 2 (K,V) x layers x kv heads x head dim x 4 bytes.
    cfg = json.loads((checkpoint / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    block = 32  # BuildConfig's default kv_block_size
    assert args["kv_cache_config"]["max_tokens"] == 2**20 // (per_token * block) * block
    assert args["triton_config"] == {"max_batch_size": 0, "decoupled": True}  # streams
    assert "TensorRT-LLM 1.2.0rc8" in (repo / "tensorrt_llm" / "1" / "model.yaml").read_text()


def test_the_model_files_are_copied_and_the_image_template_compared(checkpoint, tmp_path):
    source = fake_models_dir(tmp_path)
    repo = emit_repo(checkpoint, tmp_path / "repo", trtllm_models_dir=T(source, repo="llmapi"))
    for dest, rel in llmapi.FILES.items():
        assert (repo / "tensorrt_llm" / "1" / dest).read_text() == (source / rel).read_text()
    # An image whose llmapi template is 1.2's while we write 0.19's (the default): drift.
    ours12 = emit_repo(checkpoint, tmp_path / "r12", trtllm_models_dir=T(repo="llmapi", version="1.2.0rc8"))
    (source / llmapi.TEMPLATE).resolve().write_text((ours12 / "tensorrt_llm" / "config.pbtxt").read_text())
    with pytest.raises(TrtllmDrift, match="input 'sampling_param_best_of' is in the template"):
        emit_repo(checkpoint, tmp_path / "r19", trtllm_models_dir=T(source, repo="llmapi"))


def test_an_engine_directory_is_not_what_the_llmapi_model_loads(trtllm_engine, tmp_path):
    with pytest.raises(ValueError, match="serves a Hugging Face checkpoint"):
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=T(repo="llmapi"))
    with pytest.raises(ValueError, match="trtllm repository 'other'"):
        T(repo="other")


def test_serve_checks_for_tensorrt_llm_and_the_model_files(checkpoint, tmp_path):
    repo = emit_repo(checkpoint, tmp_path / "repo", trtllm_models_dir=T(repo="llmapi"))
    with pytest.raises(RuntimeError, match="imports tensorrt_llm, which is not installed here"):
        check_trtllm_repo(repo, tmp_path / "backends")
    with pytest.raises(FileNotFoundError, match="tensorrt_llm/1/model.py"):
        check_trtllm_repo(repo, tmp_path / "backends", installed="1.2.0rc8")
    repo = emit_repo(checkpoint, tmp_path / "repo2",
                     trtllm_models_dir=T(fake_models_dir(tmp_path / "img"), repo="llmapi"))
    check_trtllm_repo(repo, tmp_path / "backends", installed="1.2.0rc8")
