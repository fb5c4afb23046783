"""`emit-repo --disaggregated`: router `ensemble`, `context` and `generation` models, each with
its own phase's parameters only (typed configs that parse back)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.model_repo.test_emit import REQUIRED
from trtforge.cli.triton import emit_repo_command
from trtforge.config.runtime import Phase
from trtforge.model_repo.disaggregated import DisaggregatedOptions, PhaseOptions
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.phases import (
    CPUS,
    HANDOFF_TIMEOUT,
    PHASE,
    ROLE,
    ROUTER_ROLE,
    parse_cpus,
    refuse_other_phase,
    scheduler_fields,
)
from trtforge.model_repo.python_models import ENGINE_PY, ROUTER_PY


def _emit(engine_dir, repo, *flags):
    result = CliRunner().invoke(emit_repo_command, [str(engine_dir), str(repo), "--disaggregated", *flags])
    return result


def test_cli_writes_three_models_each_with_its_phase_parameters(engine_dir, tmp_path):
    result = _emit(engine_dir, tmp_path / "repo", "--context-prefill-chunk-size", "64",
                   "--context-kv-cache-memory", "2MiB", "--context-cpus", "0",
                   "--context-handoff-timeout-s", "5", "--generation-max-batch-size", "4",
                   "--generation-policy", "guaranteed_no_evict", "--generation-cpus", "1",
                   "--generation-instances", "2")
    assert result.exit_code == 0, result.output
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir()) == ["context", "ensemble", "generation"]
    router = read_config(repo / "ensemble" / "config.pbtxt")
    assert router.parameters[ROLE].string_value == ROUTER_ROLE
    assert {i.name for i in router.input} >= set(REQUIRED)
    assert (repo / "ensemble" / "1" / "model.py").read_bytes() == ROUTER_PY.read_bytes()
    ctx = read_config(repo / "context" / "config.pbtxt")
    gen = read_config(repo / "generation" / "config.pbtxt")
    for config, phase in ((ctx, Phase.CONTEXT), (gen, Phase.GENERATION)):
        assert config.name == phase and config.model_transaction_policy.decoupled
        assert (repo / phase / "1" / "model.py").read_bytes() == ENGINE_PY.read_bytes()
        assert {"request_type", "context_phase_params"} <= {i.name for i in config.input}
        assert "context_phase_params" in {o.name for o in config.output}
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert params[PHASE] == phase
        scheduling = set(params) & set(scheduler_fields(Phase.BOTH))
        assert scheduling == set(scheduler_fields(phase))  # all of its phase's, none of the other's
        refuse_other_phase(phase, [k for k, v in params.items() if v])  # what the model checks at load
    c = {k: v.string_value for k, v in ctx.parameters.items()}
    g = {k: v.string_value for k, v in gen.parameters.items()}
    assert (c["prefill_chunk_size"], c["kv_cache_memory"], c[CPUS], c[HANDOFF_TIMEOUT]) == ("64", "2MiB", "0", "5.0")
    assert (g["max_batch_size"], g["policy"], g[CPUS]) == ("4", "guaranteed_no_evict", "1")
    assert HANDOFF_TIMEOUT not in g and "max_batch_size" not in c
    assert gen.instance_group[0].count == 2 and ctx.instance_group[0].count == 1


@pytest.mark.parametrize("phase, name, other", [
    (Phase.CONTEXT, "max_batch_size", "generation"), (Phase.CONTEXT, "kv_watermark", "generation"),
    (Phase.GENERATION, "prefill_chunk_size", "context"), (Phase.GENERATION, HANDOFF_TIMEOUT, "context")])
def test_a_parameter_of_the_other_phase_is_refused_by_name(phase, name, other):
    with pytest.raises(ValueError, match=rf"'{name}' belongs to the {other} model"):
        refuse_other_phase(phase, ["engine_dir", name])


def test_bad_phase_options_are_refused_at_emit(engine_dir, tmp_path):
    result = CliRunner().invoke(emit_repo_command, [str(engine_dir), str(tmp_path / "a"),
                                                    "--generation-max-batch-size", "4"])
    assert result.exit_code != 0 and "need --disaggregated" in result.output
    result = _emit(engine_dir, tmp_path / "b", "--max-batch-size", "4")
    assert result.exit_code != 0 and "--generation-" in result.output
    result = _emit(engine_dir, tmp_path / "c", "--context-cpus", "0-x")
    assert result.exit_code != 0 and "cpus='0-x' is invalid" in result.output
    result = _emit(engine_dir, tmp_path / "d", "--generation-max-batch-size", "0")
    assert result.exit_code != 0 and "max_batch_size=0 is invalid" in result.output
    with pytest.raises(ValueError, match="prefill_chunk_size"):  # the API refuses it too
        emit_repo(engine_dir, tmp_path / "e", disaggregated=DisaggregatedOptions(
            generation=PhaseOptions(scheduler={"prefill_chunk_size": 8})))
    assert not (tmp_path / "e").exists()  # nothing half-written


def test_parse_cpus():
    assert parse_cpus("") == set() and parse_cpus("1") == {1}
    assert parse_cpus("0-2, 5") == {0, 1, 2, 5}


def test_handoff_key_and_peers_options_reach_their_phase_models(engine_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _emit(engine_dir, tmp_path / "repo", "--context-kv-connector", "tcp://:7000",
                   "--context-kv-auth-key-file", "kv.key", "--generation-kv-auth-key-file", "kv.key",
                   "--generation-kv-peers", "hostA, hostB:7000")
    assert result.exit_code == 0, result.output
    ctx, gen = ({k: v.string_value for k, v in read_config(tmp_path / "repo" / m / "config.pbtxt").parameters.items()}
                for m in ("context", "generation"))
    assert ctx["kv_auth_key_file"] == gen["kv_auth_key_file"] == str(tmp_path / "kv.key")  # absolute
    assert gen["kv_peers"] == "hostA, hostB:7000" and "kv_peers" not in ctx
    assert ctx["kv_connector"] == "tcp://:7000"
    refuse_other_phase(Phase.GENERATION, list(gen))
    refuse_other_phase(Phase.CONTEXT, list(ctx))
    with pytest.raises(ValueError, match="kv_peers belongs to the generation model"):
        emit_repo(engine_dir, tmp_path / "bad", disaggregated=DisaggregatedOptions(
            context=PhaseOptions(kv_peers="hostA")))
    result = _emit(engine_dir, tmp_path / "bad2", "--generation-kv-peers", "tcp://h:x")
    assert result.exit_code != 0 and "kv_peers entry" in result.output
