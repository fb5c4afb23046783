"""Speculative decoding through a real tritonserver: an engine built with `build-engine
--speculative-config`, its repository emitted without the flag (engine.json's default becomes the
model's parameter), served; greedy answers equal the in-process engine's without speculation, the
last response carries TensorRT-LLM's per-request acceptance outputs, the `speculative` input opts a
request out, and the Prometheus counters count the drafts."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

import pytest

from tests.e2e.helpers import BUILD_FLAGS, run_cli
from trtforge.model_repo import client
from trtforge.model_repo.launcher import TritonServer
from trtforge.model_repo.pbtxt import parameters_of, read_config

pytestmark = pytest.mark.e2e

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPTS = ["one two three one two three one two", "the cat and the cat and the cat and the"]
MAX_TOKENS = 24


@dataclass
class Served:
    server: TritonServer
    expected: dict[str, str]
    """Greedy text of each prompt from the in-process engine with speculation off, the oracle."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-e2e")
    run_cli("trtforge", "demo-checkpoint", str(root / "ckpt"), "--arch", "qwen2", "--size", "tiny")
    run_cli("build-engine", str(root / "ckpt"), "--output", str(root / "engine"), "-q", *BUILD_FLAGS,
            "--speculative-config", SPEC)
    run_cli("trtforge", "emit-repo", str(root / "engine"), str(root / "repo"))
    params = parameters_of(read_config(root / "repo" / "ensemble" / "config.pbtxt"))
    assert '"num_speculative_tokens": 3' in params["speculative_config"]  # engine.json's default, written
    server = TritonServer(root / "repo", log_file=root / "tritonserver.log")
    server.start()
    try:
        from trtforge.config.runtime import RuntimeConfig
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(root / "engine", RuntimeConfig(speculative_config="none"))
        assert engine.spec is None
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        expected = {p: o.text for p, o in zip(PROMPTS, outs)}
        server.wait_ready(300)
    except BaseException:
        server.stop()
        raise
    yield Served(server, expected)
    server.stop()


def _ask(served: Served, prompt: str, **options) -> dict:
    return client.generate_http(served.server.http_url, prompt, MAX_TOKENS, exclude_input_in_output=True,
                                min_tokens=MAX_TOKENS, **options)


def test_greedy_answers_equal_plain_decoding_and_carry_the_acceptance(served):
    drafted = 0
    for prompt in PROMPTS:
        answer = _ask(served, prompt)
        assert answer["text_output"] == served.expected[prompt]
        n, drafts, accepted = (answer["num_output_tokens"], answer["total_draft_tokens"],
                               answer["total_accepted_draft_tokens"])
        assert n == MAX_TOKENS and 0 <= accepted <= drafts
        assert answer["acceptance_rate"] == pytest.approx(accepted / drafts if drafts else 0.0, rel=1e-6)
        # Every step commits its accepted drafts plus one token (min_tokens = max_tokens: nothing is
        # cut after a stop), so the model's own count of steps gives exactly n / (n - accepted).
        assert answer["avg_decoded_tokens_per_iter"] == pytest.approx(n / (n - accepted), rel=1e-6)
        drafted += drafts
    assert drafted > 0, "the engine.json default did not reach the served model"


def test_the_speculative_input_opts_a_request_out(served):
    prompt = PROMPTS[0]
    answer = _ask(served, prompt, speculative=False)
    assert answer["text_output"] == served.expected[prompt]
    assert (answer["total_draft_tokens"], answer["total_accepted_draft_tokens"]) == (0, 0)
    assert answer["acceptance_rate"] == 0.0 and answer["avg_decoded_tokens_per_iter"] == 1.0
    assert _ask(served, prompt, speculative=True)["total_draft_tokens"] > 0


def test_a_stream_ends_with_the_counts_and_prometheus_counts_the_drafts(served):
    prompt = PROMPTS[1]
    events = list(client.stream_http(served.server.http_url, prompt, MAX_TOKENS, min_tokens=MAX_TOKENS))
    assert "".join(e.get("text_output", "") for e in events) == served.expected[prompt]
    assert "total_draft_tokens" in events[-1] and all("total_draft_tokens" not in e for e in events[:-1])
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    values = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(trtforge_spec_decode_\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE)}
    assert values["trtforge_spec_decode_num_draft_tokens_total"] > 0
    assert 0 <= values["trtforge_spec_decode_num_accepted_tokens_total"] <= \
        values["trtforge_spec_decode_num_draft_tokens_total"]
    assert values["trtforge_spec_decode_num_drafts_total"] > 0
