"""Config generation of the Triton repository: typed, parseable, complete, validated."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner
from tritonclient.grpc import model_config_pb2 as mc

from trtforge.cli.triton import emit_repo_command
from trtforge.config.fields import parse_text
from trtforge.config.scheduler import SchedulerConfig
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.params import ENGINE_DIR, KV_CACHE_MEMORY, scheduler_parameter_names, scheduler_values
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.python_models import ENGINE_PY

# The ensemble interface TensorRT-LLM clients rely on.
REQUIRED = {"text_input": mc.TYPE_STRING, "max_tokens": mc.TYPE_INT32}
OPTIONAL = {
    "temperature": mc.TYPE_FP32, "top_k": mc.TYPE_INT32, "top_p": mc.TYPE_FP32,
    "seed": mc.TYPE_UINT64, "stop_words": mc.TYPE_STRING, "bad_words": mc.TYPE_STRING,
    "end_id": mc.TYPE_INT32, "pad_id": mc.TYPE_INT32, "repetition_penalty": mc.TYPE_FP32,
    "presence_penalty": mc.TYPE_FP32, "frequency_penalty": mc.TYPE_FP32,
    "min_tokens": mc.TYPE_INT32, "stream": mc.TYPE_BOOL, "return_log_probs": mc.TYPE_BOOL,
    "exclude_input_in_output": mc.TYPE_BOOL,
}


def test_repo_parses_back_with_the_reference_interface(engine_dir, tmp_path):
    repo = emit_repo(engine_dir, tmp_path / "repo", max_num_tokens=256, prefill_chunk_size=64)
    config = read_config(repo / "ensemble" / "config.pbtxt")
    assert config.name == "ensemble" and config.backend == "python"
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 8  # the engine's, so clients may send a batch dim of 1
    inputs = {i.name: i for i in config.input}
    for name, dtype in {**REQUIRED, **OPTIONAL}.items():
        assert inputs[name].data_type == dtype, name
        assert inputs[name].optional == (name in OPTIONAL), name
    outputs = {o.name: o.data_type for o in config.output}
    assert outputs["text_output"] == mc.TYPE_STRING
    assert outputs["cum_log_probs"] == outputs["output_log_probs"] == mc.TYPE_FP32
    assert (repo / "ensemble" / "1" / "model.py").read_bytes() == ENGINE_PY.read_bytes()
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble"]  # no temp dirs left behind


def test_parameters_carry_engine_and_every_scheduling_field(engine_dir, tmp_path):
    repo = emit_repo(engine_dir, tmp_path / "repo", prefill_chunk_size=64,
                     policy="guaranteed_no_evict", enable_prefix_caching=False,
                     kv_cache_memory="2MiB")
    params = parameters_of(read_config(repo / "ensemble" / "config.pbtxt"))
    assert params[ENGINE_DIR] == str(engine_dir.resolve())
    assert params[KV_CACHE_MEMORY] == "2MiB"
    names = [f.name for f in dataclasses.fields(SchedulerConfig)]
    assert set(names) - set(SchedulerConfig.ENGINE_FIELDS) <= set(params)
    # Round trip: what the model will read is what was asked for, typed.
    values = scheduler_values(params)
    assert values["max_batch_size"] == 8  # engine.json's default, not SchedulerConfig's
    assert values["max_num_tokens"] == 256 and values["prefill_chunk_size"] == 64
    assert values["policy"] == "guaranteed_no_evict" and values["enable_prefix_caching"] is False
    assert values["prefill_max_tokens"] is None
    # Fields that describe the engine are the engine's: not parameters.
    assert not set(SchedulerConfig.ENGINE_FIELDS) & set(params)
    # Each parameter is documented in the file, for the operator who edits it.
    text = (repo / "ensemble" / "config.pbtxt").read_text()
    for name in scheduler_parameter_names():
        assert f"#   {name}: {SchedulerConfig.field_docs()[name]}" in text


@pytest.mark.parametrize("override, named", [
    ({"prefill_chunk_size": -1}, "prefill_chunk_size"),
    ({"policy": "fastest"}, "policy"),
    ({"kv_watermark": 0.9}, "kv_watermark"),
    ({"max_num_tokens": 64}, "prefill_chunk_size=256"),  # engine default no longer fits
    ({"num_blocks": 10}, "describe the engine"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
])
def test_invalid_scheduling_value_names_the_parameter(engine_dir, tmp_path, override, named):
    with pytest.raises(ValueError, match=named):  # ConfigError is a ValueError
        emit_repo(engine_dir, tmp_path / "repo", **override)
    assert not (tmp_path / "repo" / "ensemble").exists()


def test_unknown_override_lists_the_known_names(engine_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown scheduling parameter.*max_num_tokens"):
        emit_repo(engine_dir, tmp_path / "repo", max_num_seqs=4)


def test_missing_engine_json_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="build-engine"):
        emit_repo(tmp_path, tmp_path / "repo")


def test_reemit_replaces_the_model_and_keeps_other_models(engine_dir, tmp_path):
    repo = tmp_path / "repo"
    (repo / "other").mkdir(parents=True)
    emit_repo(engine_dir, repo, max_num_tokens=256)
    emit_repo(engine_dir, repo, max_num_tokens=512)
    params = parameters_of(read_config(repo / "ensemble" / "config.pbtxt"))
    assert params["max_num_tokens"] == "512"
    assert (repo / "other").is_dir()


def test_parameter_strings_parse_with_errors_naming_the_parameter():
    assert parse_text("x", "true", bool) is True
    assert parse_text("x", "off", bool) is False
    assert parse_text("x", "12", int) == 12
    assert parse_text("x", "12.0", int) == 12  # the same rules as build-engine --schedule
    assert parse_text("x", "", int | None) is None
    with pytest.raises(ValueError, match="max_num_tokens='sixty' is invalid: expected int"):
        scheduler_values({"max_num_tokens": "sixty"})
    with pytest.raises(ValueError, match="enable_prefix_caching='maybe' is invalid: expected bool"):
        scheduler_values({"enable_prefix_caching": "maybe"})


def test_cli_emit_repo_reports_a_bad_value(engine_dir, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(emit_repo_command, [str(engine_dir), str(tmp_path / "r"),
                                           "--max-num-tokens", "300", "--policy", "max_utilization"])
    assert ok.exit_code == 0, ok.output
    params = parameters_of(read_config(tmp_path / "r" / "ensemble" / "config.pbtxt"))
    assert params["max_num_tokens"] == "300"
    bad = runner.invoke(emit_repo_command, [str(engine_dir), str(tmp_path / "r2"),
                                            "--kv-watermark", "0.75"])
    assert bad.exit_code != 0 and "kv_watermark=0.75" in bad.output
