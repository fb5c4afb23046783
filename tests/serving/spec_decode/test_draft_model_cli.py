"""`trtforge generate --speculative-config '{"method": "draft_model", "model": DIR}'`: the same
greedy output as without it, the request's acceptance in --json, and clear errors for a draft
that is missing or does not share the target's vocabulary."""

import json

import pytest
from click.testing import CliRunner

from tests.helpers.checkpoints import build_tiny_engine, make_checkpoint
from trtforge.cli.generate import generate
from trtforge.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PROMPT = "one two three one two three one two"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("draft-cli"), "llama")


def run(engine_dir, *extra):
    return CliRunner().invoke(generate, [str(engine_dir), "--prompt", PROMPT, "--max-tokens", "24",
                                         "--ignore-eos", "--json", *extra])


def draft_config(model) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 4})


def test_generate_with_a_draft_model_keeps_the_output_and_reports_acceptance(engine_dir):
    plain = run(engine_dir)
    assert plain.exit_code == 0, plain.output
    spec = run(engine_dir, "--speculative-config", draft_config(engine_dir))  # the engine as its own draft
    assert spec.exit_code == 0, spec.output
    a, b = json.loads(plain.output), json.loads(spec.output)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert b["num_draft_tokens"] > 0 and b["num_accepted_tokens"] >= 0.9 * b["num_draft_tokens"]


def test_a_missing_or_foreign_draft_is_a_clear_error(engine_dir, tmp_path):
    missing = run(engine_dir, "--speculative-config", draft_config(tmp_path / "nowhere"))
    assert missing.exit_code != 0
    assert "is not a trtforge engine directory" in missing.output and "nowhere" in missing.output
    foreign = tmp_path / "foreign"
    built = CliRunner().invoke(main, ["build", str(make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=640)),
                                      "-o", str(foreign), "--dtype", "float32", "--max-seq-len", "64",
                                      "--kv-cache-memory", "2MiB", "-q"])
    assert built.exit_code == 0, built.output
    result = run(engine_dir, "--speculative-config", draft_config(foreign))
    assert result.exit_code != 0
    assert "has vocab_size=640" in result.output and "a draft must share the target's tokenizer" in result.output
    no_model = run(engine_dir, "--speculative-config", '{"method": "draft_model"}')
    assert no_model.exit_code != 0 and 'method draft_model needs "model"' in no_model.output
