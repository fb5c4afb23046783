"""The emitted configs against the recorded upstream interface of each release: model names, tensor
names, types, dims and flags, parameter keys, ensemble maps; typed values; no placeholders left."""

from __future__ import annotations

import pytest

from tests.model_repo.trtllm.conftest import RELEASE_VERSIONS, record_of
from trtforge.builder.trtllm.versions import RELEASES, TARGET
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


@pytest.mark.parametrize("version", RELEASE_VERSIONS)
def test_each_record_is_its_release(version):
    release, record = RELEASES[version], record_of(version)
    assert record["release"] == release.backend_release
    assert record["commit"] == release.backend_commit
    assert record["source"] == release.backend_source
    assert U.facts(release) == record  # the package's copy is the recorded one, unedited
    assert TARGET.tensorrt_llm == "0.19.0"  # the default stays the pinned image's release


@pytest.mark.parametrize("disaggregated", [False, True])
def test_models_tensors_and_parameter_keys_are_upstreams(release_engine, tmp_path, disaggregated):
    version, engine = release_engine
    record = record_of(version)
    repo = emit_repo(engine, tmp_path / "repo", disaggregated=disaggregated)
    assert sorted(p.name for p in repo.iterdir()) == sorted(LAYOUTS[disaggregated])
    for name in LAYOUTS[disaggregated]:
        config = read_config(repo / name / "config.pbtxt")  # parses back as ModelConfig
        facts, model = facts_of(config), record["models"][UPSTREAM_NAME.get(name, name)]
        assert config.name == name
        assert (config.backend, config.platform) == (
            "tensorrtllm" if model["backend"] == "${triton_backend}" else model["backend"],
            model["platform"])
        assert [t.as_list() for t in facts.inputs] == _dedup(model["inputs"]), (version, name)
        assert [t.as_list() for t in facts.outputs] == _dedup(model["outputs"]), (version, name)
        assert facts.parameters == model["parameters"], (version, name)
        for key, value in model["fixed_parameters"].items():
            assert config.parameters[key].string_value == value


def test_the_releases_name_seed_and_minimum_length_differently(tmp_path):
    """The drift the records exist for: 0.19's random_seed/min_length are 1.2's seed/min_tokens."""
    from tests.model_repo.trtllm.conftest import write_engine

    names = {}
    for version in RELEASE_VERSIONS:
        repo = emit_repo(write_engine(tmp_path / version, version), tmp_path / f"repo-{version}")
        names[version] = {i.name for i in read_config(repo / "ensemble" / "config.pbtxt").input}
        llm = read_config(repo / "tensorrt_llm" / "config.pbtxt")
        names[version + "/llm"] = {o.name for o in llm.output} | set(llm.parameters)
    assert {"random_seed", "min_length"} <= names["0.19.0"] and not {"seed", "min_tokens"} & names["0.19.0"]
    assert {"seed", "min_tokens", "return_num_input_tokens"} <= names["1.2.0rc8"]
    assert not {"random_seed", "min_length"} & names["1.2.0rc8"]
    assert {"num_input_tokens", "num_output_tokens", "enable_trt_overlap"} <= names["1.2.0rc8/llm"]
    assert not {"num_input_tokens", "enable_trt_overlap"} & names["0.19.0/llm"]


def test_the_ensemble_lists_one_output_twice_and_we_write_it_once():
    for version in RELEASE_VERSIONS:
        names = [t[0] for t in record_of(version)["models"]["ensemble"]["outputs"]]
        assert names.count("kv_cache_alloc_total_blocks") == 2
        written = [t.name for t in U.tensors("ensemble", "outputs", RELEASES[version])]
        assert written.count("kv_cache_alloc_total_blocks") == 1


@pytest.mark.parametrize("disaggregated", [False, True])
def test_ensemble_steps_are_upstreams(release_engine, tmp_path, disaggregated):
    version, engine = release_engine
    repo = emit_repo(engine, tmp_path / "repo", disaggregated=disaggregated)
    steps = facts_of(read_config(repo / "ensemble" / "config.pbtxt")).steps
    llm = "disaggregated_serving_bls" if disaggregated else "tensorrt_llm"
    expected = [{**s, "model_name": llm if s["model_name"] == "tensorrt_llm" else s["model_name"]}
                for s in record_of(version)["models"]["ensemble"]["steps"]]
    assert steps == expected
    config = read_config(repo / "ensemble" / "config.pbtxt")
    assert all(s.model_version == -1 for s in config.ensemble_scheduling.step)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_nothing_is_left_unfilled(release_engine, tmp_path, disaggregated):
    repo = emit_repo(release_engine[1], tmp_path / "repo", disaggregated=disaggregated)
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
def test_every_value_has_the_type_its_reader_parses(release_engine, tmp_path, disaggregated):
    version, engine = release_engine
    repo = emit_repo(engine, tmp_path / "repo", disaggregated=disaggregated)
    for name in LAYOUTS[disaggregated]:
        config = read_config(repo / name / "config.pbtxt")
        if config.platform == "ensemble":
            assert not config.parameters
            continue
        kinds = U.kinds(RELEASES[version], "tensorrt_llm" if config.backend == "tensorrtllm" else name)
        assert set(kinds) == set(config.parameters), name
        for key, param in config.parameters.items():
            _check_kind(key, param.string_value, kinds[key])


def test_a_recorded_parameter_without_a_kind_is_an_error(monkeypatch):
    release = RELEASES["1.2.0rc8"]
    monkeypatch.delitem(U.TENSORRT_LLM_KINDS, "enable_trt_overlap")
    with pytest.raises(ValueError, match="does not know how to fill: enable_trt_overlap"):
        U.kinds(release, "tensorrt_llm")
