"""`trtforge emit-repo` and `build-engine` with the TensorRT-LLM options, run for real through
Click: the trtllm options reach the emitter (--trtllm-repo, --trtllm-version, --allow-trtllm-drift),
the files written follow the recorded release, and contradicting options are refused."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from tests.model_repo.trtllm.conftest import fake_models_dir, record_of
from trtforge.builder.trtllm.versions import ALLOW_DRIFT_ENV
from trtforge.cli.build import build_engine
from trtforge.cli.triton import emit_repo_command
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.trtllm import llmapi
from trtforge.model_repo.trtllm.templates import facts_of


def test_emit_repo_command_writes_the_trtllm_layout(trtllm_engine, tmp_path):
    result = CliRunner().invoke(emit_repo_command, [str(trtllm_engine), str(tmp_path / "repo"),
                                                    "--disaggregated", "--policy",
                                                    "guaranteed_no_evict"])
    assert result.exit_code == 0, result.output
    assert parameters_of(read_config(tmp_path / "repo" / "generation" / "config.pbtxt"))[
        "batch_scheduler_policy"] == "guaranteed_no_evict"
    bad = CliRunner().invoke(emit_repo_command, [str(trtllm_engine), str(tmp_path / "r2"),
                                                 "--prefill-chunk-size", "100000"])
    assert bad.exit_code != 0 and "prefill_chunk_size" in bad.output


def test_emit_repo_command_stops_on_drift_and_the_env_override_lets_it_go_on(tmp_path, monkeypatch):
    from tests.model_repo.trtllm.conftest import write_engine

    engine = write_engine(tmp_path / "engine", "1.1.0")
    result = CliRunner().invoke(emit_repo_command, [str(engine), str(tmp_path / "repo")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "TensorRT-LLM 1.1.0 has no recorded Triton interface" in result.output
    assert ALLOW_DRIFT_ENV in result.output
    monkeypatch.setenv(ALLOW_DRIFT_ENV, "1")
    result = CliRunner().invoke(emit_repo_command, [str(engine), str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", arch="qwen2", seed=3)


def _run(command, args):
    return CliRunner().invoke(command, [str(a) for a in args])


def _model_yaml(repo) -> dict:
    return yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())


def _llmapi_interface(repo) -> tuple[list, list]:
    facts = facts_of(read_config(repo / "tensorrt_llm" / "config.pbtxt"))
    return [t.as_list() for t in facts.inputs], [t.as_list() for t in facts.outputs]


@pytest.mark.parametrize("version", ["0.19.0", "1.2.0rc8"])
def test_emit_repo_writes_the_llmapi_repository_of_the_release_asked_for(checkpoint, tmp_path, version):
    repo = tmp_path / "repo"
    result = _run(emit_repo_command, [checkpoint, repo, "--trtllm-repo", "llmapi", "--trtllm-version", version,
                                      "--policy", "guaranteed_no_evict", "--kv-cache-memory", "1MiB"])
    assert result.exit_code == 0, result.output
    assert "models `tensorrt_llm`" in result.output
    assert sorted(p.name for p in repo.iterdir()) == ["tensorrt_llm"]
    record = record_of(version)["llmapi"]["tensorrt_llm"]
    assert _llmapi_interface(repo) == (record["inputs"], record["outputs"])
    args = _model_yaml(repo)
    assert args["model"] == str(checkpoint.resolve())
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert f"TensorRT-LLM {version}" in (repo / "tensorrt_llm" / "1" / "model.yaml").read_text()


def test_emit_repo_llmapi_takes_a_hub_id_and_copies_the_model_files(checkpoint, tmp_path, monkeypatch):
    from trtforge.builder import checkpoint as ckpt_mod

    hub_id = "SomeOrg/tiny-qwen2"  # not a directory here: only the llmapi repository may take it
    real_resolve = ckpt_mod.resolve
    monkeypatch.setattr(ckpt_mod, "resolve", lambda p: checkpoint if p == hub_id else real_resolve(p))
    source = fake_models_dir(tmp_path / "image")
    repo = tmp_path / "repo"
    result = _run(emit_repo_command, [hub_id, repo, "--trtllm-repo", "llmapi", "--trtllm-models-dir", source])
    assert result.exit_code == 0, result.output
    assert _model_yaml(repo)["model"] == hub_id  # TensorRT-LLM downloads it where it runs
    for dest, rel in llmapi.FILES.items():
        assert (repo / "tensorrt_llm" / "1" / dest).read_text() == (source / rel).read_text()
    refused = _run(emit_repo_command, [hub_id, tmp_path / "r2"])  # an engine must be a directory
    assert refused.exit_code == 2 and "does not exist" in refused.output
    assert not (tmp_path / "r2").exists()


def test_emit_repo_llmapi_refuses_what_it_cannot_write(checkpoint, trtllm_engine, tmp_path):
    bad = _run(emit_repo_command, [checkpoint, tmp_path / "r", "--trtllm-repo", "llmapi", "--device", "cuda:1",
                                   "--triton-max-batch-size", "4"])
    assert bad.exit_code == 2 and "--device, --triton-max-batch-size: not options of the llmapi" in bad.output
    bad = _run(emit_repo_command, [checkpoint, tmp_path / "r", "--trtllm-repo", "llmapi", "--disaggregated"])
    assert bad.exit_code == 1 and "no disaggregated layout" in bad.output
    bad = _run(emit_repo_command, [trtllm_engine, tmp_path / "r", "--trtllm-repo", "llmapi"])
    assert bad.exit_code == 1 and "is an engine directory" in bad.output
    bad = _run(emit_repo_command, [tmp_path / "nowhere", tmp_path / "r", "--trtllm-repo", "llmapi"])
    assert bad.exit_code == 1 and "does not exist" in bad.output and "Traceback" not in bad.output
    bad = _run(emit_repo_command, [checkpoint, tmp_path / "r", "--trtllm-repo", "other"])
    assert bad.exit_code == 2 and "inflight_batcher_llm" in bad.output
    assert not (tmp_path / "r").exists()


def test_trtllm_version_and_the_drift_flags(trtllm_engine, tmp_path, monkeypatch):
    # A 0.19.0 engine written for 1.2.0rc8: an engine of another version, drift.
    bad = _run(emit_repo_command, [trtllm_engine, tmp_path / "r", "--trtllm-version", "1.2.0rc8"])
    assert bad.exit_code == 1 and "built with TensorRT-LLM 0.19.0" in bad.output
    assert "TensorRT-LLM 1.2.0rc8 (asked for)" in bad.output and not (tmp_path / "r").exists()
    assert "On the command line: --allow-trtllm-drift." in bad.output
    ok = _run(emit_repo_command, [trtllm_engine, tmp_path / "r", "--trtllm-version", "1.2.0rc8",
                                  "--allow-trtllm-drift"])
    assert ok.exit_code == 0, ok.output
    inputs = {i.name for i in read_config(tmp_path / "r" / "ensemble" / "config.pbtxt").input}
    assert {"seed", "min_tokens"} <= inputs and not {"random_seed", "min_length"} & inputs  # 1.2's names
    # A version without a record: refused, and the flag beats the environment either way.
    bad = _run(emit_repo_command, [trtllm_engine, tmp_path / "r3", "--trtllm-version", "1.1.0"])
    assert bad.exit_code == 1 and "TensorRT-LLM 1.1.0 has no recorded Triton interface" in bad.output
    monkeypatch.setenv(ALLOW_DRIFT_ENV, "1")
    bad = _run(emit_repo_command, [trtllm_engine, tmp_path / "r3", "--trtllm-version", "1.1.0",
                                   "--no-allow-trtllm-drift"])
    assert bad.exit_code == 1 and "has no recorded Triton interface" in bad.output
    assert not (tmp_path / "r3").exists()


def test_trtllm_options_are_refused_for_a_trtforge_engine(engine_dir, tmp_path):
    bad = _run(emit_repo_command, [engine_dir, tmp_path / "r", "--trtllm-version", "0.19.0"])
    assert bad.exit_code == 1 and "TensorRT-LLM options are for engines built with --backend trtllm" in bad.output


def test_build_engine_llmapi_writes_the_repository_and_builds_nothing(checkpoint, tmp_path):
    repo = tmp_path / "repo"
    result = _run(build_engine, [checkpoint, "--backend", "trtllm", "--trtllm-repo", "llmapi",
                                 "--triton-repo", repo, "--max-seq-len", "64", "--kv-cache-memory", "1MiB",
                                 "--max-batch-size", "4", "--schedule", "policy=guaranteed_no_evict"])
    assert result.exit_code == 0, result.output
    assert "no engine built" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no engine directory anywhere
    args = _model_yaml(repo)
    assert (args["max_seq_len"], args["max_batch_size"]) == (64, 4)
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert args["model"] == str(checkpoint.resolve())
    record = record_of("0.19.0")["llmapi"]["tensorrt_llm"]  # no TensorRT-LLM here: the default release
    assert _llmapi_interface(repo) == (record["inputs"], record["outputs"])


@pytest.mark.parametrize(("extra", "message"), [
    (["--trtllm-repo", "llmapi"], "--trtllm-repo llmapi writes only a Triton repository: give --triton-repo"),
    (["--trtllm-repo", "inflight_batcher_llm", "--output", "{tmp}/engine"],
     "--trtllm-repo inflight_batcher_llm describes a Triton repository: give --triton-repo"),
    (["--trtllm-repo", "llmapi", "--triton-repo", "{tmp}/repo", "--output", "{tmp}/engine"],
     "--output: --trtllm-repo llmapi builds no engine"),
    (["--trtllm-repo", "llmapi", "--triton-repo", "{tmp}/repo", "--disaggregated"],
     "--disaggregated: --trtllm-repo llmapi builds no engine"),
    (["--backend", "torch", "--trtllm-repo", "llmapi", "--triton-repo", "{tmp}/repo"],
     "--trtllm-repo is for --backend trtllm (here: --backend torch)"),
    (["--backend", "torch"], "Missing option '--output'"),
])
def test_build_engine_refuses_contradicting_trtllm_repo_options(checkpoint, tmp_path, extra, message):
    args = [checkpoint, *(a.format(tmp=tmp_path) for a in extra)]
    if "--backend" not in extra:
        args[1:1] = ["--backend", "trtllm"]
    result = _run(build_engine, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []
