"""`trtforge generate --speculative-config`: the same greedy output, the request's acceptance in
--json, and a clear error for a bad config."""

import json

import pytest
from click.testing import CliRunner

from tests.helpers.checkpoints import build_tiny_engine
from trtforge.cli.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PROMPT = "one two three one two three one two"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("spec-cli"), "llama")


def run(engine_dir, *extra):
    result = CliRunner().invoke(generate, [str(engine_dir), "--prompt", PROMPT, "--max-tokens", "24",
                                           "--ignore-eos", "--json", *extra])
    return result


def test_speculative_generate_reports_acceptance_and_keeps_the_output(engine_dir):
    plain = run(engine_dir)
    assert plain.exit_code == 0, plain.output
    spec = run(engine_dir, "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    assert spec.exit_code == 0, spec.output
    a, b = json.loads(plain.output), json.loads(spec.output)
    assert "num_draft_tokens" not in a
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert b["num_draft_tokens"] > 0 and 0 <= b["num_accepted_tokens"] <= b["num_draft_tokens"]


def test_a_bad_speculative_config_is_a_clear_error(engine_dir):
    result = run(engine_dir, "--speculative-config", '{"method": "medusa"}')
    assert result.exit_code != 0
    assert "speculative method 'medusa' is not supported" in result.output
