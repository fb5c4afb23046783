"""An engine's default speculative decoding: `build-engine --speculative-config` checks it before any
work and records it in engine.json; `trtforge generate` and `LLMEngine.from_engine_dir` run it
unless told otherwise (an explicit config replaces it, `none` turns it off), with greedy output
identical either way; engine.json files without it load as before."""

import json
import re

import pytest
from click.testing import CliRunner

from tests.helpers.checkpoints import build_tiny_engine
from trtforge.cli.generate import generate
from trtforge.cli.main import main
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.speculative import SpeculativeConfig
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.errors import EngineLoadError
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PROMPT = "one two three one two three one two"
DEFAULT = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("spec-default"), "llama", "--speculative-config", DEFAULT)


def run(engine_dir, *extra):
    result = CliRunner().invoke(generate, [str(engine_dir), "--prompt", PROMPT, "--max-tokens", "24",
                                           "--ignore-eos", "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_build_records_the_default_in_engine_json(spec_engine):
    raw = json.loads((spec_engine / "engine.json").read_text())
    assert raw["speculative_config"] == json.loads(SpeculativeConfig.parse(DEFAULT).to_json())
    assert "speculative_config" not in raw["build"]  # recorded once, as the engine's default
    recorded = read_engine_config(spec_engine).speculative_config
    assert SpeculativeConfig.parse(recorded) == SpeculativeConfig.parse(DEFAULT)


def test_generate_uses_the_default_and_none_turns_it_off_with_the_same_greedy_output(spec_engine):
    default = run(spec_engine)
    off = run(spec_engine, "--speculative-config", "none")
    assert default["num_draft_tokens"] > 0, "the engine.json default was not used"
    assert 0 <= default["num_accepted_tokens"] <= default["num_draft_tokens"]
    assert "num_draft_tokens" not in off  # no speculation: no acceptance reported
    assert default["output_ids"] == off["output_ids"] and default["text"] == off["text"]
    assert len(off["output_ids"]) == 24


def test_an_explicit_config_replaces_the_default(spec_engine):
    k1 = '{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}'
    engines = {name: LLMEngine.from_engine_dir(spec_engine, runtime) for name, runtime in (
        ("default", RuntimeConfig()), ("explicit", RuntimeConfig(speculative_config=k1)),
        ("off", RuntimeConfig(speculative_config="none")))}
    assert engines["default"].spec.config == SpeculativeConfig.parse(DEFAULT)
    assert engines["explicit"].spec.config.num_speculative_tokens == 1
    assert engines["off"].spec is None
    explicit = run(spec_engine, "--speculative-config", k1)
    assert explicit["num_draft_tokens"] > 0
    assert explicit["output_ids"] == run(spec_engine, "--speculative-config", "none")["output_ids"]


def test_an_engine_without_a_default_does_not_speculate_and_keeps_its_engine_json(tmp_path):
    plain = build_tiny_engine(tmp_path, "llama")
    raw = json.loads((plain / "engine.json").read_text())
    assert "speculative_config" not in raw  # engine.json of an engine without one is as before the option
    assert read_engine_config(plain).speculative_config is None
    assert LLMEngine.from_engine_dir(plain).spec is None
    assert "num_draft_tokens" not in run(plain)


def test_an_edited_default_fails_the_load_naming_it(spec_engine, tmp_path):
    raw = json.loads((spec_engine / "engine.json").read_text())
    raw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 99}
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(EngineLoadError, match="speculative_config .* is invalid .*num_speculative_tokens=99"):
        read_engine_config(edited, verify_checksums=False)


@pytest.mark.parametrize("flags, message", [
    (["--speculative-config", "{not json"], "is not JSON"),
    (["--speculative-config", '{"method": "eagle"}'], "speculative method 'eagle' is not supported"),
    (["--speculative-config", '{"num_speculative_tokens": 4, "k": 2}'], r"unknown field\(s\) \['k'\]"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'], "num_speculative_tokens=0 is invalid"),
    (["--speculative-config", "{}", "--tp-size", "2"], r"not supported with a tensor-parallel engine \(tp_size=2\)"),
    (["--speculative-config", "{}", "--backend", "tensorrt"], "not supported with the tensorrt backend"),
    (["--speculative-config", "{}", "--backend", "trtllm"], "not supported with the trtllm backend"),
])
def test_a_bad_or_unsupported_config_fails_the_build_before_any_work(tmp_path, flags, message):
    # The checkpoint does not exist: the refusal must come before anything is read or written.
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(tmp_path / "no-such-checkpoint"), "-o", str(out), *flags])
    assert result.exit_code != 0
    assert "--speculative-config" in result.output
    assert re.search(message, result.output), result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_context_phase_never_runs_the_default():
    default = SpeculativeConfig.parse(DEFAULT)
    assert RuntimeConfig().speculation(json.loads(default.to_json())) == default
    assert RuntimeConfig(phase="context").speculation(json.loads(default.to_json())) is None
    assert RuntimeConfig(phase="generation").speculation(json.loads(default.to_json())) == default
    assert RuntimeConfig(speculative_config="none").speculation(json.loads(default.to_json())) is None
    assert RuntimeConfig.from_text({"speculative_config": "none"}).speculation(default) is None
    assert RuntimeConfig.from_text({"speculative_config": ""}).speculation(default) == default


@pytest.mark.parametrize("off", ["none", "None", " null "])
def test_none_and_null_turn_speculation_off(off):
    assert RuntimeConfig(speculative_config=off).speculation({"num_speculative_tokens": 2}) is None
