"""Values from our build and scheduling config, the mapping table, reports of what does not carry
over, TensorRT-LLM's model.py files, and emit_repo's dispatch on engine.json's backend."""

from __future__ import annotations

import json
import logging

import pytest

from tests.model_repo.trtllm.conftest import fake_models_dir
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.params import scheduler_parameter_names
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.trtllm.files import MODEL_FILES
from trtforge.model_repo.trtllm.mapping import SCHEDULING, mapping_table_markdown


def _params(repo, model="tensorrt_llm"):
    return parameters_of(read_config(repo / model / "config.pbtxt"))


def test_parameters_come_from_the_build_and_the_scheduling_options(trtllm_engine, tmp_path):
    repo = emit_repo(trtllm_engine, tmp_path / "repo", policy="guaranteed_no_evict",
                     enable_prefix_caching=False, prefill_chunk_size=0, max_queue_size=7,
                     kv_cache_memory="2MiB", exclude_input_in_output=True, device="cuda:1",
                     triton_max_batch_size=4)
    p = _params(repo)
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["gpt_model_path"] == p["tokenizer_dir"] == str(trtllm_engine.resolve())
    assert p["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert p["enable_kv_cache_reuse"] == "false" and p["enable_chunked_context"] == "false"
    assert p["max_tokens_in_paged_kv_cache"] == str(2 * 2**20 // 4096)  # whole 16-token blocks
    assert p["max_attention_window_size"] == "128" and p["max_beam_width"] == "1"
    assert p["exclude_input_in_output"] == "true" and p["gpu_device_ids"] == "1"
    config = read_config(repo / "tensorrt_llm" / "config.pbtxt")
    assert config.model_transaction_policy.decoupled
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 7
    assert config.max_batch_size == 4 and list(config.dynamic_batching.preferred_batch_size) == [4]
    assert [(g.kind, g.count) for g in config.instance_group] == [(config.instance_group[0].KIND_CPU, 1)]
    pre = _params(repo, "preprocessing")
    assert pre["tokenizer_dir"] == str(trtllm_engine.resolve())
    assert pre["add_special_tokens"] == "false"  # as trtforge's own runtime encodes prompts
    assert _params(repo, "postprocessing")["skip_special_tokens"] == "true"
    assert _params(repo, "tensorrt_llm_bls")["tensorrt_llm_model_name"] == "tensorrt_llm"


def test_engine_defaults_apply_when_nothing_is_given(trtllm_engine, tmp_path):
    p = _params(emit_repo(trtllm_engine, tmp_path / "repo"))
    assert p["batch_scheduler_policy"] == "max_utilization"  # SchedulerConfig's default
    assert p["enable_kv_cache_reuse"] == "true"
    assert p["enable_chunked_context"] == "true"  # engine.json: prefill_chunk_size 256
    assert p["max_tokens_in_paged_kv_cache"] == str(4 * 2**20 // 4096)  # engine's 4MiB
    assert p["gpu_device_ids"] == "" and p["participant_ids"] == ""


def test_the_mapping_table_covers_every_scheduling_option():
    assert list(SCHEDULING) == scheduler_parameter_names()
    table = mapping_table_markdown()
    for name in SCHEDULING:
        assert f"`{name}`" in table


def test_options_without_counterpart_are_reported_not_dropped(trtllm_engine, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        repo = emit_repo(trtllm_engine, tmp_path / "repo", prefill_max_seqs=2, kv_watermark=0.1,
                         prefill_order="shortest_first", max_queued_tokens=500, max_num_tokens=200,
                         prefill_chunk_size=200)
    text = caplog.text
    for item in ("prefill_max_seqs=2", "kv_watermark=0.1", "prefill_order='shortest_first'",
                 "max_queued_tokens=500", "max_num_tokens=200", "prefill_chunk_size=200"):
        assert item in text
        assert item in (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "engine was built with max_num_tokens=256" in text


def test_options_matching_tensorrt_llm_are_not_reported(trtllm_engine, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        emit_repo(trtllm_engine, tmp_path / "repo", kv_watermark=0.0, prefill_chunk_size=0, max_queued_tokens=0)
    assert "not carried over" not in caplog.text


def test_disaggregated_phases_have_their_own_values(trtllm_engine, tmp_path):
    repo = tmp_path / "repo"
    emit_repo(trtllm_engine, repo)  # a plain layout first: its tensorrt_llm models must go
    emit_repo(trtllm_engine, repo, disaggregated=True)
    assert not (repo / "tensorrt_llm").exists() and not (repo / "tensorrt_llm_bls").exists()
    context, generation = _params(repo, "context"), _params(repo, "generation")
    assert (context["gpu_device_ids"], context["participant_ids"]) == ("0", "1")
    assert (generation["gpu_device_ids"], generation["participant_ids"]) == ("1", "2")
    assert context["enable_chunked_context"] == "true"
    assert generation["enable_chunked_context"] == "false"  # the generation phase prefills nothing
    bls = _params(repo, "disaggregated_serving_bls")
    assert (bls["context_model_name"], bls["generation_model_name"]) == ("context", "generation")


def test_model_py_files_are_copied_from_the_models_dir(trtllm_engine, tmp_path):
    source = fake_models_dir(tmp_path)
    for disaggregated in (False, True):
        repo = emit_repo(trtllm_engine, tmp_path / f"repo{disaggregated}",
                         trtllm_models_dir=source, disaggregated=disaggregated)
        for model, files in MODEL_FILES.items():
            if (repo / model).exists():
                for dest, rel in files.items():
                    assert (repo / model / "1" / dest).read_text() == (source / rel).read_text()


def test_without_models_dir_the_files_to_add_are_listed(trtllm_engine, tmp_path, caplog,
                                                        monkeypatch):
    monkeypatch.delenv("TRTFORGE_TRTLLM_MODELS_DIR", raising=False)
    with caplog.at_level(logging.WARNING):
        repo = emit_repo(trtllm_engine, tmp_path / "repo")
    assert "preprocessing/1/model.py  <- all_models/inflight_batcher_llm/preprocessing/1/model.py" \
        in caplog.text
    assert "tensorrt_llm_bls/1/lib/decode.py" in caplog.text
    assert not (repo / "preprocessing" / "1" / "model.py").exists()


def test_trtllm_options_are_refused_for_other_engines(tmp_path, trtllm_engine):
    torch_engine = tmp_path / "torch"
    torch_engine.mkdir()
    raw = json.loads((trtllm_engine / "engine.json").read_text())
    (torch_engine / "engine.json").write_text(json.dumps({**raw, "backend": "torch"}))
    with pytest.raises(ValueError, match="--backend trtllm"):  # (--disaggregated serves torch engines too)
        emit_repo(torch_engine, tmp_path / "repo", trtllm_models_dir=tmp_path)
