"""vLLM's /tokenize with chat `messages` and `tools` through the real app: the prompt it counts is
the prompt a chat completion with the same messages and tools sends to the ensemble (read back by
the model's own request parser), for a template that renders tools (Qwen 2.5's) and one that does
not (tools go into the system prompt, tool_prompt.py). Through a real tritonserver, count ==
usage.prompt_tokens: tests/e2e/test_openai_tokenize_tools.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend import server
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece
from trtforge.model_repo.request import parse_request

QWEN_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string"}}}}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


class PromptBridge(StubBridge):
    prompts: list = []

    async def generate(self, arrays):
        PromptBridge.prompts.append(parse_request(arrays).prompt)
        yield Piece("ok", [], True, num_input_tokens=1, num_output_tokens=1, finish_reason="stop")


@pytest.fixture(params=[QWEN_TEMPLATE, PLAIN_TEMPLATE], ids=["template-takes-tools", "tools-in-system-prompt"])
def client(request, monkeypatch):
    tok = tiny_tokenizer()
    original = tok.chat_template
    tok.chat_template = request.param  # the cached tokenizer: its own template put back after
    monkeypatch.setattr(server, "TritonBridge", PromptBridge)
    monkeypatch.setattr(PromptBridge, "prompts", [])
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tok, max_seq_len=512)
    try:
        with TestClient(server.create_app(served, "127.0.0.1:1"), raise_server_exceptions=False) as client:
            yield client, tok
    finally:
        tok.chat_template = original


def test_tokenize_with_tools_counts_the_chat_completions_prompt(client):
    client, tok = client
    answer = client.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                            "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    assert client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                                     "max_tokens": 4}).status_code == 200
    prompt = PromptBridge.prompts[-1]
    assert "get_weather" in prompt  # the tools are in the prompt the completion sent
    body = answer.json()
    assert body["tokens"] == tok.encode(prompt, add_special_tokens=False) and body["count"] == len(body["tokens"])
    without = client.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert without["count"] < body["count"]  # the tools were counted, not ignored


def test_tools_without_messages_or_malformed_are_400s(client):
    client, _ = client
    response = client.post("/tokenize", json={"model": "tiny", "prompt": "Hi", "tools": [WEATHER]})
    assert response.status_code == 400 and "send them with messages" in response.json()["error"]["message"]
    twice = client.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, WEATHER]})
    assert twice.status_code == 400
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}
    response = client.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [bad]})
    assert response.status_code == 400, response.text  # as the chat completion would answer
    assert "not a JSON Schema trtforge can enforce" in response.json()["error"]["message"]
