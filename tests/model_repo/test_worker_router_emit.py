"""`emit-repo ENGINE REPO --only router --worker-url …`: a router `ensemble` over co-located
workers, its parameters, and the combinations refused by name."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.model_repo.test_emit import REQUIRED
from trtforge.cli.triton import emit_repo_command
from trtforge.frontend.served_model import engine_dir_of
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.phases import ROLE
from trtforge.model_repo.python_models import ROUTER_PY


def _emit(engine_dir, repo, *flags):
    return CliRunner().invoke(emit_repo_command, [str(engine_dir), str(repo), *flags])


def test_writes_a_router_over_the_workers(engine_dir, tmp_path):
    repo = tmp_path / "router"
    result = _emit(engine_dir, repo, "--only", "router", "--worker-url", "10.0.0.1:8001",
                   "--worker-url", "10.0.0.2:8001", "--router-max-imbalance", "3")
    assert result.exit_code == 0, result.output
    assert [p.name for p in repo.iterdir()] == ["ensemble"]
    config = read_config(repo / "ensemble" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params == {"engine_dir": str(engine_dir.resolve()), "exclude_input_in_output": "false",
                      ROLE: "router", "worker_model": "ensemble",
                      "worker_urls": "10.0.0.1:8001,10.0.0.2:8001", "router_policy": "prefix-affinity",
                      "router_max_imbalance": "3", "router_max_blocks": "65536"}
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 8
    assert {i.name for i in config.input} >= set(REQUIRED)
    assert (repo / "ensemble" / "1" / "model.py").read_bytes() == ROUTER_PY.read_bytes()
    assert engine_dir_of(repo) == engine_dir.resolve()  # what the OpenAI front end reads
    result = _emit(engine_dir, repo, "--only", "router", "--worker-url", "w:1", "--router-policy", "least-loaded")
    assert result.exit_code == 0, result.output
    assert read_config(repo / "ensemble" / "config.pbtxt").parameters["router_policy"].string_value == "least-loaded"


@pytest.mark.parametrize(("flags", "message"), [
    (["--only", "router"], "routes over co-located workers: give --worker-url"),
    (["--worker-url", "w:1"], "--worker-url: only with --only router"),
    (["--router-policy", "least-loaded"], "--router-policy: only with --only router"),
    (["--only", "router", "--worker-url", "w:1", "--context-url", "c:1"], "need --disaggregated"),
    (["--disaggregated", "--only", "router", "--worker-url", "w:1", "--context-url", "c:1",
      "--generation-url", "g:1"], "a disaggregated router takes --context-url and --generation-url"),
    (["--only", "context"], "need --disaggregated"),
    (["--only", "router", "--worker-url", "w:1", "--max-batch-size", "4", "--kv-cache-memory", "1MiB"],
     "--kv-cache-memory, --max-batch-size: not options of a router over co-located workers"),
    (["--only", "router", "--worker-url", " , "], "--only router needs the servers it routes to"),
])
def test_impossible_combinations_are_refused_by_name(engine_dir, tmp_path, flags, message):
    result = _emit(engine_dir, tmp_path / "repo", *flags)
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "repo").exists()
