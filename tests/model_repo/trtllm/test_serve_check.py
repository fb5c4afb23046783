"""`trtforge serve` on a trtllm repository: the checks before Triton starts, and the pure version
check refusing an engine built by another TensorRT-LLM."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from tests.model_repo.engines import engine_json
from tests.model_repo.trtllm.conftest import write_engine
from trtforge.builder.trtllm.versions import TARGET, version_mismatch
from trtforge.cli.triton import serve_command
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.trtllm.files import MODEL_FILES
from trtforge.model_repo.trtllm.serve_check import check_trtllm_repo, engine_version


def test_version_check_is_exact_and_names_both():
    assert version_mismatch("0.19.0", "0.19.0") is None
    message = version_mismatch("0.19.0", "0.20.0")
    assert "0.19.0" in message and "0.20.0" in message
    assert version_mismatch("0.19.0", "0.19.0.post1") is not None  # engines are not portable
    assert "not installed" in version_mismatch("0.19.0", None)
    assert "records no TensorRT-LLM version" in version_mismatch(None, "0.19.0")


@pytest.fixture()
def repo(trtllm_engine, tmp_path):
    source = tmp_path / "all_models" / "inflight_batcher_llm"
    for files in MODEL_FILES.values():
        for rel in files.values():
            path = (source / rel).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("# stand-in\n")
    return emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=source)


@pytest.fixture()
def backends(tmp_path):
    d = tmp_path / "backends"
    (d / "tensorrtllm").mkdir(parents=True)
    (d / "python").mkdir()
    return d


def test_a_server_without_the_tensorrtllm_backend_is_refused(repo, tmp_path):
    (tmp_path / "plain" / "python").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="tensorrtllm") as err:
        check_trtllm_repo(repo, tmp_path / "plain", installed="0.19.0")
    assert TARGET.image in str(err.value)


def test_an_engine_of_another_tensorrt_llm_is_refused(repo, backends):
    with pytest.raises(RuntimeError, match="built with TensorRT-LLM 0.19.0, but TensorRT-LLM 0.21.0"):
        check_trtllm_repo(repo, backends, installed="0.21.0")
    check_trtllm_repo(repo, backends, installed="0.19.0")  # the same version: fine


def test_missing_python_models_are_named(repo, backends):
    (repo / "postprocessing" / "1" / "model.py").unlink()
    with pytest.raises(FileNotFoundError, match="postprocessing/1/model.py"):
        check_trtllm_repo(repo, backends, installed="0.19.0")


def test_a_disaggregated_repository_needs_the_launch_script_and_the_kv_transfer_env(
        trtllm_engine, tmp_path, backends, caplog):
    with caplog.at_level(logging.WARNING):
        repo = emit_repo(trtllm_engine, tmp_path / "disagg", disaggregated=True)
    command = ("TRTLLM_USE_MPI_KVCACHE=1 python3 /app/scripts/launch_triton_server.py --world_size 3 "
               "--tensorrt_llm_model_name context,generation --multi-model --disable-spawn-processes "
               f"--model_repo {repo.resolve()}")
    assert command in caplog.text  # emit-repo prints it
    with pytest.raises(RuntimeError) as err:
        check_trtllm_repo(repo, backends, installed="0.19.0")
    assert command.replace(str(repo.resolve()), str(repo)) in str(err.value)  # and serve refuses with it
    assert "TensorRT-LLM 0.19.0 docs" in str(err.value)  # where the variable comes from


def test_the_launch_command_follows_the_engines_release(tmp_path, backends):
    repo = emit_repo(write_engine(tmp_path / "e12", "1.2.0rc8"), tmp_path / "disagg", disaggregated=True)
    with pytest.raises(RuntimeError) as err:
        check_trtllm_repo(repo, backends, installed="1.2.0rc8")
    assert "TRTLLM_USE_MPI_KVCACHE=1 python3 triton_backend/scripts/launch_triton_server.py" in str(err.value)
    assert "CacheTransceiverConfig(BackendType::MPI)" in str(err.value)


def test_other_repositories_pass_untouched(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')
    check_trtllm_repo(tmp_path, tmp_path / "no-backends")


def test_engine_version_falls_back_to_tensorrt_llms_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"version": "0.19.0"}))
    assert engine_version(tmp_path) == "0.19.0"
    (tmp_path / "engine.json").write_text(engine_json(build={}, scheduling={},
                                                      versions={"tensorrt_llm": "0.18.2"}))
    assert engine_version(tmp_path) == "0.18.2"


def test_serve_stops_with_the_message_here(repo):
    """This machine's tritonserver (the nvidia-pytriton wheel) has no tensorrtllm backend."""
    pytest.importorskip("pytriton", reason="needs the nvidia-pytriton wheel's tritonserver")
    result = CliRunner().invoke(serve_command, [str(repo), "--ready-timeout", "5"])
    assert result.exit_code != 0
    assert "tensorrtllm" in result.output and TARGET.image in result.output
