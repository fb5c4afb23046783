"""The emitted configs against the recorded upstream interface: model names, tensor names, types,
dims and flags, parameter keys, ensemble maps; typed values; no placeholders left."""

from __future__ import annotations

import pytest

from trtforge.builder.trtllm.versions import TARGET
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.trtllm import upstream as U
from trtforge.model_repo.trtllm.files import LAYOUTS
from trtforge.model_repo.trtllm.templates import facts_of

UPSTREAM_NAME = {"context": "tensorrt_llm", "generation": "tensorrt_llm"}


def _dedup(tensors: list) -> list:
    seen: dict = {}
    for t in tensors:
        seen.setdefault(t[0], t)
    return list(seen.values())


def test_the_record_is_the_release_trtforge_targets(upstream):
    assert upstream["release"] == TARGET.backend_release
    assert upstream["commit"] == TARGET.backend_commit
    assert upstream["source"] == TARGET.backend_source
    assert U.facts() == upstream  # the package's copy is the recorded one, unedited


@pytest.mark.parametrize("disaggregated", [False, True])
def test_models_tensors_and_parameter_keys_are_upstreams(trtllm_engine, tmp_path, upstream,
                                                         disaggregated):
    repo = emit_repo(trtllm_engine, tmp_path / "repo", disaggregated=disaggregated)
    assert sorted(p.name for p in repo.iterdir()) == sorted(LAYOUTS[disaggregated])
    for name in LAYOUTS[disaggregated]:
        config = read_config(repo / name / "config.pbtxt")  # parses back as ModelConfig
        facts, record = facts_of(config), upstream["models"][UPSTREAM_NAME.get(name, name)]
        assert config.name == name
        assert (config.backend, config.platform) == (
            "tensorrtllm" if record["backend"] == "${triton_backend}" else record["backend"],
            record["platform"])
        assert [t.as_list() for t in facts.inputs] == _dedup(record["inputs"]), name
        assert [t.as_list() for t in facts.outputs] == _dedup(record["outputs"]), name
        assert facts.parameters == record["parameters"], name
        for key, value in record["fixed_parameters"].items():
            assert config.parameters[key].string_value == value


def test_v0_19_ensemble_lists_one_output_twice_and_we_write_it_once(upstream):
    names = [t[0] for t in upstream["models"]["ensemble"]["outputs"]]
    assert names.count("kv_cache_alloc_total_blocks") == 2
    assert [t.name for t in U.tensors("ensemble", "outputs")].count("kv_cache_alloc_total_blocks") == 1


@pytest.mark.parametrize("disaggregated", [False, True])
def test_ensemble_steps_are_upstreams(trtllm_engine, tmp_path, upstream, disaggregated):
    repo = emit_repo(trtllm_engine, tmp_path / "repo", disaggregated=disaggregated)
    steps = facts_of(read_config(repo / "ensemble" / "config.pbtxt")).steps
    llm = "disaggregated_serving_bls" if disaggregated else "tensorrt_llm"
    expected = [{**s, "model_name": llm if s["model_name"] == "tensorrt_llm" else s["model_name"]}
                for s in upstream["models"]["ensemble"]["steps"]]
    assert steps == expected
    config = read_config(repo / "ensemble" / "config.pbtxt")
    assert all(s.model_version == -1 for s in config.ensemble_scheduling.step)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_nothing_is_left_unfilled(trtllm_engine, tmp_path, disaggregated):
    repo = emit_repo(trtllm_engine, tmp_path / "repo", disaggregated=disaggregated)
    for path in repo.rglob("*"):
        if path.is_file():
            assert "${" not in path.read_text(), path


def _check_kind(key: str, value: str, kind: str) -> None:
    if kind == U.BOOL:
        assert value in ("true", "false"), (key, value)
    elif kind == U.INT:
        assert str(int(value)) == value, (key, value)
    elif kind == U.FLOAT:
        float(value)
        assert value.strip() == value and value, (key, value)
    elif kind == U.CSV_INTS:
        assert value == "" or all(str(int(x)) == x for x in value.split(",")), (key, value)
    elif kind == U.UNSET:
        assert value == "" and key in U.UNSET_WHY, (key, value)
    elif kind == U.PATH:
        assert value.startswith("/"), (key, value)
    else:
        assert kind == U.TEXT and value, (key, value)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_every_value_has_the_type_its_reader_parses(trtllm_engine, tmp_path, disaggregated):
    repo = emit_repo(trtllm_engine, tmp_path / "repo", disaggregated=disaggregated)
    for name in LAYOUTS[disaggregated]:
        config = read_config(repo / name / "config.pbtxt")
        kinds = (U.TENSORRT_LLM_KINDS if config.backend == "tensorrtllm"
                 else U.PYTHON_MODEL_KINDS.get(name, {}))
        assert set(kinds) == set(config.parameters), name
        for key, param in config.parameters.items():
            _check_kind(key, param.string_value, kinds[key])
