"""`trtforge emit-repo` on a --backend trtllm engine: the trtllm options reach the emitter."""

from __future__ import annotations

from click.testing import CliRunner

from trtforge.cli.triton import emit_repo_command
from trtforge.model_repo.pbtxt import parameters_of, read_config


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
    from trtforge.builder.trtllm.versions import ALLOW_DRIFT_ENV

    engine = write_engine(tmp_path / "engine", "1.1.0")
    result = CliRunner().invoke(emit_repo_command, [str(engine), str(tmp_path / "repo")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "TensorRT-LLM 1.1.0 has no recorded Triton interface" in result.output
    assert ALLOW_DRIFT_ENV in result.output
    monkeypatch.setenv(ALLOW_DRIFT_ENV, "1")
    result = CliRunner().invoke(emit_repo_command, [str(engine), str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
