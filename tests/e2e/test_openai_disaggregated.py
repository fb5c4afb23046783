"""The OpenAI-compatible API in front of a disaggregated repository: `trtforge serve REPO
--openai-port` on `emit-repo --disaggregated` (the router `ensemble` → `context` → `generation`, KV
through shared memory), called with the real `openai` SDK.

The front end finds the engine directory through the phase models' config.pbtxt; greedy text
equals the co-located engine's (the in-process LLMEngine, the oracle of test_openai.py), and what
the engine reports (finish and stop reasons, top_logprobs, cached prompt tokens) passes through the
router. A router alone (`--only router`) needs `--served-engine-dir`. The count of tests here is
checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import run_cli
from tests.e2e.openai_server import start_serve
from tests.e2e.test_openai import CHATS, MAX_TOKENS, PROMPTS, check_cached_tokens, check_top_logprobs_and_reasons

pytestmark = pytest.mark.e2e

NAME = "tiny-disagg"


@pytest.fixture(scope="module")
def disagg(engine_dir, tmp_path_factory):
    from trtforge.serving.engine import LLMEngine

    root = tmp_path_factory.mktemp("openai-disagg")
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "repo"), "--disaggregated")
    serve = start_serve(root / "repo", root / "tritonserver.log", "--served-model-name", NAME)
    try:
        client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
        yield client, LLMEngine.from_engine_dir(engine_dir), root
    finally:
        assert serve.stop() == 0, "".join(serve.output)


def _chat_prompt(engine, messages: list[dict]) -> str:
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]
    return engine.tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)


def test_disaggregated_repository_serves_the_colocated_answers(disagg):
    from trtforge.config.sampling import SamplingParams

    client, engine, _ = disagg
    assert [m.id for m in client.models.list().data] == [NAME]
    for prompt in PROMPTS:
        (want,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.num_prompt_tokens,
                                                                          len(want.output_token_ids))
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == len(want.output_token_ids)
    for messages in CHATS:
        (want,) = engine.generate([_chat_prompt(engine, messages)], SamplingParams(max_tokens=MAX_TOKENS))
        got = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
    check_top_logprobs_and_reasons(client, engine, NAME, lambda m: _chat_prompt(engine, m))
    check_cached_tokens(client, NAME, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))


def test_a_router_alone_needs_the_served_engine_dir(disagg, engine_dir, tmp_path):
    """`emit-repo --only router` (the router on its own host): no engine in the repository, so the
    front end asks for --served-engine-dir, and with it reads the engine's tokenizer and limits."""
    from trtforge.frontend.served_model import load_served_model

    _, engine, _ = disagg
    repo = tmp_path / "router-only"
    run_cli("trtforge", "emit-repo", str(engine_dir), str(repo), "--disaggregated", "--only", "router",
            "--context-url", "ctx-host:8001", "--generation-url", "gen-host:8001")
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble"]
    with pytest.raises(ValueError, match="--served-engine-dir"):
        load_served_model(repo)
    served = load_served_model(repo, engine_dir=engine_dir)
    assert (served.name, served.max_seq_len) == (Path(engine_dir).name, engine.scheduler_config.max_seq_len)
    # The command refuses the same way, before starting anything.
    import subprocess

    from tests.e2e.helpers import BIN

    out = subprocess.run([str(BIN / "trtforge"), "serve", str(repo), "--openai-port", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--served-engine-dir" in out.stderr + out.stdout
