"""`emit-repo --speculative-config`: the engine model's `speculative_config` parameter (engine.json's
default when not given), read back by the model as its RuntimeConfig; bad configs and repository
kinds it cannot apply to are refused by name; the interface has the opt-out input and TensorRT-LLM's
per-request speculative decoding outputs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from tritonclient.grpc import model_config_pb2 as mc

from tests.model_repo.engines import engine_json
from trtforge.cli.triton import emit_repo_command
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.speculative import SpeculativeConfig
from trtforge.model_repo.client import request_arrays
from trtforge.model_repo.params import SPECULATIVE_CONFIG, runtime_config
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.request import parse_request
from trtforge.model_repo.speculation import SPECULATION_OUTPUTS, speculation_arrays, with_speculative_input
from trtforge.model_repo.trtllm.upstream import tensors

BUILD = {"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 128, "kv_block_size": 16,
         "kv_cache_memory": "4MiB"}
SCHEDULING = {"max_num_tokens": 256, "max_batch_size": 8, "prefill_chunk_size": 256, "prefill_max_seqs": 8}
DEFAULT = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
K2 = '{"method": "ngram", "num_speculative_tokens": 2}'


def engine(tmp_path, name="engine", **fields):
    d = tmp_path / name
    d.mkdir()
    (d / "engine.json").write_text(engine_json(build=BUILD, scheduling=SCHEDULING, **fields))
    return d


def emit(*args):
    return CliRunner().invoke(emit_repo_command, [str(a) for a in args])


def parameter(repo):
    return parameters_of(read_config(repo / "ensemble" / "config.pbtxt"))[SPECULATIVE_CONFIG]


@pytest.mark.parametrize("recorded, flags, expected", [
    (None, [], None),  # no default, no flag: no speculation
    (DEFAULT, [], DEFAULT),  # engine.json's default
    (DEFAULT, ["--speculative-config", K2], SpeculativeConfig.parse(K2)),  # the flag replaces it
    (DEFAULT, ["--speculative-config", "none"], None),  # and turns it off
    (None, ["--speculative-config", K2], SpeculativeConfig.parse(K2)),
])
def test_the_parameter_is_what_the_model_runs(tmp_path, recorded, flags, expected):
    default = None if recorded is None else json.loads(recorded.to_json())
    src = engine(tmp_path, speculative_config=default)
    result = emit(src, tmp_path / "repo", *flags)
    assert result.exit_code == 0, result.output
    params = parameters_of(read_config(tmp_path / "repo" / "ensemble" / "config.pbtxt"))
    if flags:
        assert params[SPECULATIVE_CONFIG] == ("none" if flags[1] == "none" else SpeculativeConfig.parse(K2).to_json())
    else:
        assert params[SPECULATIVE_CONFIG] == ("" if recorded is None else recorded.to_json())
    # What the engine model does with it (model.py: runtime_config(parameters), then the engine's
    # default from engine.json for what the parameter leaves open).
    assert runtime_config(params).speculation(default) == expected


@pytest.mark.parametrize("value, message", [
    ("{oops", "is not JSON"),
    ('{"method": "eagle"}', "speculative method 'eagle' is not supported"),
    ('{"method": "draft_model"}', 'needs "model"'),
    ('{"num_speculative_tokens": 4, "lookahead": 1}', r"unknown field\(s\) \['lookahead'\]"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min=5 and prompt_lookup_max=2 are invalid"),
])
def test_a_bad_config_is_refused_and_nothing_is_written(tmp_path, value, message):
    result = emit(engine(tmp_path), tmp_path / "repo", "--speculative-config", value)
    assert result.exit_code != 0
    assert re.search(message, result.output), result.output
    assert not (tmp_path / "repo" / "ensemble").exists()


@pytest.mark.parametrize("fields, extra, message", [
    ({"backend": "trtllm"}, [], "a --backend trtllm engine is served by TensorRT-LLM's tensorrtllm backend"),
    ({"backend": "tensorrt"}, [], "not supported with the tensorrt backend"),
    ({"tp_size": 2}, [], r"not supported with a tensor-parallel engine \(tp_size=2\)"),
    ({}, ["--disaggregated"], "not with --disaggregated"),
    ({}, ["--only", "router", "--worker-url", "127.0.0.1:9001"], "--speculative-config: not options of a router"),
])
def test_repository_kinds_it_cannot_apply_to_are_refused_by_name(tmp_path, fields, extra, message):
    result = emit(engine(tmp_path, **fields), tmp_path / "repo", "--speculative-config", K2, *extra)
    assert result.exit_code != 0
    assert re.search(message, result.output), result.output


def test_the_llmapi_repository_refuses_it(tmp_path):
    result = emit(tmp_path / "some-checkpoint", tmp_path / "repo", "--trtllm-repo", "llmapi",
                  "--speculative-config", K2)
    assert result.exit_code != 0
    assert "--speculative-config: not an option of the llmapi repository" in result.output


def test_the_interface_has_the_opt_out_and_tensorrt_llms_outputs(tmp_path):
    assert emit(engine(tmp_path), tmp_path / "repo").exit_code == 0
    config = read_config(tmp_path / "repo" / "ensemble" / "config.pbtxt")
    inputs = {i.name: i for i in config.input}
    assert inputs["speculative"].data_type == mc.TYPE_BOOL and inputs["speculative"].optional
    ours = {o.name: (mc.DataType.Name(o.data_type), tuple(o.dims)) for o in config.output}
    upstream = {t.name: (t.data_type, t.dims) for t in tensors("ensemble", "outputs")}
    for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
        assert ours[name] == upstream[name], name  # TensorRT-LLM's ensemble output, as it declares it
    assert ours["avg_decoded_tokens_per_iter"] == ("TYPE_FP32", (1,))
    assert set(SPECULATION_OUTPUTS) <= set(ours)


def test_the_speculative_input_opts_a_request_out():
    assert with_speculative_input(parse_request(request_arrays("x", 2)), {}).params.speculative is True
    arrays = request_arrays("x", 2, speculative=False)
    assert arrays["speculative"].dtype == np.bool_
    assert with_speculative_input(parse_request(arrays), arrays).params.speculative is False
    arrays = request_arrays("x", 2, speculative=True)
    assert with_speculative_input(parse_request(arrays), arrays).params.speculative is True
    with pytest.raises(ValueError, match="input 'speculative' has shape"):
        with_speculative_input(parse_request(arrays), {"speculative": np.array([[True, False]])})


def test_the_outputs_of_one_request():
    out = speculation_arrays(draft_tokens=12, accepted_tokens=3, generated=20, steps=17)
    assert {k: v.shape for k, v in out.items()} == {k: (1, 1) for k in SPECULATION_OUTPUTS}
    assert (int(out["total_draft_tokens"][0, 0]), int(out["total_accepted_draft_tokens"][0, 0])) == (12, 3)
    assert out["acceptance_rate"][0, 0] == pytest.approx(0.25)
    assert out["avg_decoded_tokens_per_iter"][0, 0] == pytest.approx(20 / 17)
    none = speculation_arrays(0, 0, 5, 5)  # an opted-out request of a speculating engine
    assert none["acceptance_rate"][0, 0] == 0.0 and none["avg_decoded_tokens_per_iter"][0, 0] == 1.0


def test_runtime_parameter_round_trip_keeps_none_apart_from_unset():
    assert RuntimeConfig.from_text({SPECULATIVE_CONFIG: "none"}).speculation(json.loads(DEFAULT.to_json())) is None
    assert RuntimeConfig.from_text({SPECULATIVE_CONFIG: ""}).speculation(json.loads(DEFAULT.to_json())) == DEFAULT
    assert RuntimeConfig.from_text({SPECULATIVE_CONFIG: K2}).speculation(None) == SpeculativeConfig.parse(K2)
