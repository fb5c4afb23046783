"""Drift is an error naming the differences, unless the user overrides it: a TensorRT-LLM version
without a record, an engine of another version than the one written for, an image whose templates
differ from the record (build-side: tests/builder/trtllm/test_trtllm_build.py)."""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.model_repo.trtllm.conftest import fake_models_dir, write_engine
from trtforge.builder.trtllm.versions import (
    ALLOW_DRIFT_ENV,
    RELEASES,
    TrtllmDrift,
    nearest_release,
    release_for,
)
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.trtllm.values import TrtllmOptions as T


def test_recorded_versions_are_picked_exactly_and_others_refused():
    assert release_for("0.19.0") is RELEASES["0.19.0"]
    assert release_for("1.2.0rc8") is RELEASES["1.2.0rc8"]
    assert release_for(None).tensorrt_llm == "0.19.0"
    with pytest.raises(TrtllmDrift, match="1.1.0 has no recorded Triton interface") as err:
        release_for("1.1.0")
    assert "0.19.0, 1.2.0rc8" in str(err.value) and ALLOW_DRIFT_ENV in str(err.value)
    assert release_for("1.1.0", allow_drift=True).tensorrt_llm == "1.2.0rc8"  # same major line
    assert nearest_release("0.21.0").tensorrt_llm == "0.19.0"
    assert nearest_release("2.0.0").tensorrt_llm == "1.2.0rc8"  # newest older one


def test_an_engine_of_an_unrecorded_version_stops_the_emission(tmp_path, monkeypatch, caplog):
    engine = write_engine(tmp_path / "engine", "1.1.0")
    with pytest.raises(TrtllmDrift, match="TensorRT-LLM 1.1.0 has no recorded Triton interface"):
        emit_repo(engine, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    monkeypatch.setenv(ALLOW_DRIFT_ENV, "1")  # the explicit override: the nearest record
    repo = emit_repo(engine, tmp_path / "repo")
    inputs = {i.name for i in read_config(repo / "tensorrt_llm" / "config.pbtxt").input}
    assert {"seed", "min_tokens"} <= inputs


def test_writing_for_another_version_than_the_engines_is_drift(trtllm_engine, tmp_path):
    with pytest.raises(TrtllmDrift, match="built with TensorRT-LLM 0.19.0.*written for TensorRT-LLM 1.2.0rc8"):
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=T(version="1.2.0rc8"))
    repo = emit_repo(trtllm_engine, tmp_path / "repo",
                     trtllm_models_dir=T(version="1.2.0rc8", allow_drift=True))
    assert "enable_trt_overlap" in parameters_of(read_config(repo / "tensorrt_llm" / "config.pbtxt"))


def _image_of(version: str, tmp_path):
    """An "image" whose templates are those of `version`: our own configs for it (their facts equal
    the release's record, tests/model_repo/trtllm/test_upstream_interface.py), laid out as all_models."""
    source = fake_models_dir(tmp_path / f"image-{version}")
    ours = emit_repo(write_engine(tmp_path / f"e-{version}", version), tmp_path / f"ours-{version}")
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        (source / model).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ours / model / "config.pbtxt", source / model / "config.pbtxt")
    return source


def test_an_image_of_another_release_is_refused_with_the_differences(trtllm_engine, tmp_path, caplog):
    """The issue's case: 0.19 configs in an image whose backend reads 1.2's seed and min_tokens."""
    image = _image_of("1.2.0rc8", tmp_path)
    with pytest.raises(TrtllmDrift) as err:
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=image)
    text = str(err.value)
    for line in ("ensemble: input 'seed' is in the template, not in ours",
                 "ensemble: input 'random_seed' is ours only",
                 "tensorrt_llm: input 'min_tokens' is in the template, not in ours",
                 "tensorrt_llm: output 'num_input_tokens' is in the template, not in ours",
                 "tensorrt_llm: parameter 'enable_trt_overlap' is in the template, not in ours"):
        assert line in text
    assert ALLOW_DRIFT_ENV in text
    assert not (tmp_path / "repo").exists()  # nothing half-written
    with caplog.at_level(logging.WARNING):
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=T(image, allow_drift=True))
    assert "ensemble: input 'seed' is in the template, not in ours" in caplog.text
    assert (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").is_file()


def test_an_image_of_the_same_release_passes(trtllm_engine, tmp_path, caplog):
    image = _image_of("0.19.0", tmp_path)
    with caplog.at_level(logging.WARNING):
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=image)
    assert "differ" not in caplog.text


def test_an_extra_template_input_or_parameter_is_named(trtllm_engine, tmp_path):
    image = _image_of("0.19.0", tmp_path)
    path = image / "postprocessing" / "config.pbtxt"
    text = path.read_text().replace('input {', 'input {\n  name: "EXTRA"\n  data_type: TYPE_INT32\n  '
                                    'dims: 1\n}\ninput {', 1)
    path.write_text(text + 'parameters { key: "new_knob" value { string_value: "${new_knob}" } }\n')
    with pytest.raises(TrtllmDrift) as err:
        emit_repo(trtllm_engine, tmp_path / "repo", trtllm_models_dir=image)
    assert "postprocessing: input 'EXTRA' is in the template, not in ours" in str(err.value)
    assert "postprocessing: parameter 'new_knob' is in the template, not in ours" in str(err.value)
