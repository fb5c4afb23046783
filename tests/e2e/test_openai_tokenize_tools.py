"""vLLM's /tokenize with chat `messages` and `tools` through `trtforge serve --openai-port`: its
`count` is the `usage.prompt_tokens` a chat completion with the same messages and tools reports
(the engine's own count of the prompt it was sent), with Qwen 2.5's chat template, which renders
the tools, on the e2e engine behind a real tritonserver."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import engine_with_chat_template
from tests.e2e.openai_server import start_serve

pytestmark = pytest.mark.e2e

NAME = "tiny-tokenize-tools"
TEMPLATE = Path(__file__).parents[1] / "frontend" / "qwen2_5_chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
CONVERSATIONS = {
    "question": [{"role": "user", "content": "Weather in Oslo?"}],
    "after a call": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}],
}


@pytest.fixture(scope="module")
def serve(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-tokenize-tools")
    engine_with_chat_template(engine_dir, root, TEMPLATE)
    process = start_serve(root / "repo", root / "tritonserver.log", "--served-model-name", NAME)
    try:
        yield process
    finally:
        assert process.stop() == 0, "".join(process.output)


def _tokenize(serve, body: dict) -> dict:
    url = serve.openai_url.removesuffix("/v1") + "/tokenize"
    request = urllib.request.Request(url, data=json.dumps({"model": NAME, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_tokenize_with_tools_counts_what_a_chat_completion_with_them_uses(serve):
    client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
    for label, messages in CONVERSATIONS.items():
        counted = _tokenize(serve, {"messages": messages, "tools": TOOLS})
        used = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=1,
                                              temperature=0).usage.prompt_tokens
        assert counted["count"] == used == len(counted["tokens"]), label
        plain = _tokenize(serve, {"messages": messages})["count"]
        assert plain < counted["count"], label  # the tools are in the count
        assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                              temperature=0).usage.prompt_tokens == plain, label
