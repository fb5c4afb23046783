"""The engine's own answers through the OpenAI-compatible API (the real app, FastAPI's TestClient,
in front of a bridge that answers as the ensemble model does): finish and stop reasons, cached
prompt tokens, top log-probabilities, `echo`, and vLLM's /tokenize and /detokenize. The real
engine behind a real tritonserver: tests/e2e/test_openai.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend import server
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece, PromptEntry
from trtforge.model_repo.request import parse_request

PROMPT = "Hello there"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def prompt_entries(prompt: str, k: int) -> list[PromptEntry]:
    """What the ensemble answers for prompt_logprobs=k: one entry per prompt token after the first."""
    n = len(tiny_tokenizer().encode(prompt, add_special_tokens=False))
    return [PromptEntry(-0.5 * i, i, [(20 + j, -0.01 * (j + 1)) for j in range(k)]) for i in range(1, n)]


class EngineLikeBridge(StubBridge):
    """Answers like the ensemble model: 3 tokens in 2 responses, the last one with the counts, why it
    finished, and the cached prompt tokens; log-probabilities (the prompt's on the first response)
    only when the request asks."""

    sent: list = []

    async def generate(self, arrays):
        parsed = parse_request(arrays)
        EngineLikeBridge.sent.append(parsed)
        k = parsed.num_top_logprobs

        def top(n: int) -> list | None:
            return [[(10 + i + j, -0.1 * (j + 1)) for j in range(k)] for i in range(n)] if k else None

        logprobs = parsed.return_log_probs
        k_prompt = parsed.prompt_logprobs
        yield Piece("ab", [-0.1] if logprobs else [], False, top_logprobs=top(1),
                    prompt_logprobs=None if k_prompt is None else prompt_entries(parsed.prompt, k_prompt))
        yield Piece("c", [-0.2, -0.3] if logprobs else [], True, num_input_tokens=4, num_output_tokens=3,
                    top_logprobs=top(2), finish_reason="stop", stop_reason="\n\n", num_cached_tokens=2)


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(server, "TritonBridge", EngineLikeBridge)
    monkeypatch.setattr(EngineLikeBridge, "sent", [])
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tiny_tokenizer(),
                         max_seq_len=64)
    with TestClient(server.create_app(served, "127.0.0.1:1"), raise_server_exceptions=False) as client:
        yield client


def _events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_finish_reason_stop_reason_and_cached_tokens_are_the_engines(client):
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3}).json()
    choice = answer["choices"][0]
    # 3 tokens of max_tokens=3, yet "stop": the model said so (a count would have said "length").
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("abc", "stop", "\n\n")
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 2}}
    assert not EngineLikeBridge.sent[-1].return_log_probs  # not asked for: not computed
    chat = client.post("/v1/chat/completions", json=CHAT).json()
    assert (chat["choices"][0]["finish_reason"], chat["choices"][0]["stop_reason"]) == ("stop", "\n\n")
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    events = _events(client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}}))
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"][0]["stop_reason"] == "\n\n"
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_top_logprobs_on_chat_and_completions(client):
    tok = tiny_tokenizer()
    chat = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert EngineLikeBridge.sent[-1].num_top_logprobs == 2
    assert [c["logprob"] for c in content] == pytest.approx([-0.1, -0.2, -0.3])
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == \
        [[tok.decode([10 + i + j]) for j in range(2)] for i in (0, 0, 1)]
    assert content[2]["top_logprobs"][1]["logprob"] == pytest.approx(-0.2)
    plain = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
    assert all(c["top_logprobs"] == [] for c in plain["choices"][0]["logprobs"]["content"])
    legacy = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                  "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert legacy["tokens"] == ["ab", "c", ""] and len(legacy["top_logprobs"]) == 3
    assert list(legacy["top_logprobs"][0].values()) == pytest.approx([-0.1, -0.2, -0.3])
    events = _events(client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                          "logprobs": 1, "stream": True}))
    tops = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["top_logprobs"]]
    assert len(tops) == 3
    for body, words in (({**CHAT, "top_logprobs": 2}, "needs logprobs=true"),
                        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "less than or equal to 20")):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "top_logprobs"


def test_echo_puts_the_prompt_first(client):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == PROMPT + "abc"
    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT + "abc"
    assert EngineLikeBridge.sent[-1].prompt_logprobs is None  # echo alone needs no prompt logprobs


def test_echo_with_logprobs_puts_the_prompts_tokens_first(client):
    tok = tiny_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=False)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2}
    answer = client.post("/v1/completions", json=body).json()["choices"][0]
    assert EngineLikeBridge.sent[-1].prompt_logprobs == 2
    lp, n = answer["logprobs"], len(ids)
    assert answer["text"] == PROMPT + "abc"
    assert "".join(lp["tokens"][:n]) == PROMPT and lp["tokens"][n:] == ["ab", "c", ""]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI
    assert lp["token_logprobs"][1:n] == pytest.approx([-0.5 * i for i in range(1, n)])
    assert lp["token_logprobs"][n:] == pytest.approx([-0.1, -0.2, -0.3])
    assert lp["top_logprobs"][1] == pytest.approx({tok.decode([20]): -0.01, tok.decode([21]): -0.02})
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert lp["text_offset"][:n] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["tokens"] == lp["tokens"][:n]
    assert first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT + "abc"
    assert [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["text_offset"]] \
        == lp["text_offset"]


def test_prompt_logprobs_in_vllms_shape(client):
    tok = tiny_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=False)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert EngineLikeBridge.sent[-1].prompt_logprobs == 1
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, position in enumerate(plp[1:], start=1):
        assert position[str(ids[i])] == {"logprob": pytest.approx(-0.5 * i), "rank": i,
                                         "decoded_token": tok.decode([ids[i]])}
        assert position["20"] == {"logprob": pytest.approx(-0.01), "rank": 1, "decoded_token": tok.decode([20])}
        assert len(position) == 2
    chat = client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0}).json()
    template = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(template, add_special_tokens=False)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat_ids)
    assert [list(p) for p in chat["prompt_logprobs"][1:]] == [[str(t)] for t in chat_ids[1:]]
    assert client.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]["prompt_logprobs"]
    plain = client.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None and EngineLikeBridge.sent[-1].prompt_logprobs is None
    for bad, words in (({"prompt_logprobs": 21}, "less than or equal to 20"),
                       ({"stream": True}, "not available with stream=true")):
        refused = client.post("/v1/completions", json={**body, **bad})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def test_skip_special_tokens_goes_to_the_ensemble(client):
    client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
    assert EngineLikeBridge.sent[-1].params.skip_special_tokens is True
    client.post("/v1/chat/completions", json={**CHAT, "skip_special_tokens": False})
    assert EngineLikeBridge.sent[-1].params.skip_special_tokens is False


def test_tokenize_and_detokenize_in_vllms_shapes(client):
    tok = tiny_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=False)
    answer = client.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
    assert answer == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    strs = client.post("/tokenize", json={"model": "tiny", "prompt": PROMPT, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tok.decode([i]) for i in ids]
    chat = client.post("/tokenize", json={"model": "tiny", "messages": CHAT["messages"]}).json()
    template = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(template, add_special_tokens=False)
    assert client.post("/detokenize", json={"model": "tiny", "tokens": ids}).json() == {"prompt": tok.decode(ids)}
    for path, body, param in (("/tokenize", {"model": "tiny"}, None),
                              ("/tokenize", {"model": "tiny", "prompt": "x", "messages": CHAT["messages"]}, None),
                              ("/detokenize", {"model": "tiny", "tokens": [len(tok)]}, "tokens"),
                              ("/detokenize", {"model": "tiny", "tokens": [-1]}, "tokens.0")):
        response = client.post(path, json=body)
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text
    assert client.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    too_long = client.post("/tokenize", json={"model": "tiny", "prompt": "x" * (16 * 64 + 1)})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "prompt_too_long"
