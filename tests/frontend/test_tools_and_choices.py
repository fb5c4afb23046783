"""Tool calling and `n` through the real app (FastAPI's TestClient) in front of a bridge that answers
as the ensemble does: what reaches the ensemble (read back by the model's own request parser), the
prompt the chat template makes of tools and of a tool-call history, the grammar of forced calls,
the 400s of malformed tools, and n choices (seeds, order of sending, usage, streamed indices). The
real engine behind a real tritonserver: tests/e2e/test_openai_tools.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming._deltas import accumulate_delta

from tests.frontend.stub_bridge import StubBridge
from tests.helpers.checkpoints import tokenizer as tiny_tokenizer
from trtforge.frontend import server
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece
from trtforge.model_repo.request import parse_request

QWEN_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 40}


class ScriptedBridge(StubBridge):
    """Answers each request with `reply` in three responses; records what was sent and when."""

    reply = "plain text"
    sent: list = []
    events: list = []

    async def generate(self, arrays):
        parsed = parse_request(arrays)
        index = len(ScriptedBridge.sent)
        ScriptedBridge.sent.append(parsed)
        ScriptedBridge.events.append(("sent", index))
        text = ScriptedBridge.reply
        cuts = [0, len(text) // 3, 2 * len(text) // 3, len(text)]
        for n, (a, b) in enumerate(zip(cuts, cuts[1:])):
            await asyncio.sleep(0.01)
            if n == 0:
                ScriptedBridge.events.append(("first", index))
            last = n == 2
            yield Piece(text[a:b], [], last, **(dict(num_input_tokens=9, num_output_tokens=3 + index,
                                                     finish_reason="stop", num_cached_tokens=8 if index else 0)
                                                if last else {}))


def _client(monkeypatch) -> TestClient:
    monkeypatch.setattr(server, "TritonBridge", ScriptedBridge)
    monkeypatch.setattr(ScriptedBridge, "sent", [])
    monkeypatch.setattr(ScriptedBridge, "events", [])
    served = ServedModel(name="tiny", engine_dir=Path("/nonexistent"), tokenizer=tiny_tokenizer(), max_seq_len=256)
    return TestClient(server.create_app(served, "127.0.0.1:1"), raise_server_exceptions=False)


@pytest.fixture
def qwen(monkeypatch):
    tok = tiny_tokenizer()
    original = tok.chat_template
    tok.chat_template = QWEN_TEMPLATE  # the cached tokenizer: put its own template back after
    try:
        with _client(monkeypatch) as client:
            yield client
    finally:
        tok.chat_template = original


@pytest.fixture
def plain(monkeypatch):
    with _client(monkeypatch) as client:
        yield client


def test_tools_go_through_a_template_that_takes_them(qwen):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    ScriptedBridge.reply = "It is sunny."
    answer = qwen.post("/v1/chat/completions", json={**CHAT, "messages": history, "tools": [WEATHER]}).json()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.", "tool_calls": None}
    prompt = ScriptedBridge.sent[-1].prompt
    # The template's own words, the tool as JSON, the history's call and result in its format.
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
    assert ScriptedBridge.sent[-1].params.guided_decoding_guide_type is None  # auto: not forced
    # tool_choice none: no tools offered, nothing parsed
    ScriptedBridge.reply = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    answer = qwen.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert "# Tools" not in ScriptedBridge.sent[-1].prompt
    assert answer["choices"][0]["message"]["content"] == ScriptedBridge.reply


def test_a_template_without_tool_support_gets_them_in_the_system_prompt(plain):
    ScriptedBridge.reply = "ok"
    plain.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER, CLOCK], "messages": [
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_time", "arguments": "{}"}}]}, {"role": "tool", "content": "12:00"}]})
    prompt = ScriptedBridge.sent[-1].prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt and json.dumps(CLOCK) in prompt and "<tool_call></tool_call>" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt


def test_auto_tool_calls_are_parsed_with_finish_reason_tool_calls(qwen):
    ScriptedBridge.reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {**CHAT, "tools": [WEATHER]}
    choice = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    message, finish = _streamed(qwen.post("/v1/chat/completions", json={**body, "stream": True}))
    assert finish == ["tool_calls"] and message["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [("get_weather", call["function"]["arguments"])]


def _streamed(response) -> tuple[dict, list]:
    """The SSE chunks of one choice, accumulated as the openai SDK does; the finish reasons."""
    assert response.status_code == 200, response.text
    message: dict = {}
    finish = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                delta = {k: v for k, v in choice["delta"].items() if v is not None}
                for call in delta.get("tool_calls", []):  # as the SDK's to_dict(): unset fields absent
                    call.update({k: v for k, v in call.items() if v is not None})
                    call["function"] = {k: v for k, v in call["function"].items() if v is not None}
                accumulate_delta(message, delta)
                if choice["finish_reason"]:
                    finish.append(choice["finish_reason"])
    return message, finish


@pytest.mark.parametrize("choice, parallel, schema", [
    ({"type": "function", "function": {"name": "get_weather"}}, None,
     {"type": "object", "required": ["name", "parameters"], "additionalProperties": False, "properties": {
         "name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]}}),
    ("required", False, {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "additionalProperties": False, "properties": {
            "name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]}},
        {"type": "object", "required": ["name", "parameters"], "additionalProperties": False, "properties": {
            "name": {"const": "get_time"}, "parameters": {"type": "object", "properties": {}}}}]}),
])
def test_required_and_named_send_the_grammar_of_a_call(qwen, choice, parallel, schema):
    ScriptedBridge.reply = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    body = {**CHAT, "tools": [WEATHER, CLOCK], "tool_choice": choice,
            **({} if parallel is None else {"parallel_tool_calls": parallel})}
    answer = qwen.post("/v1/chat/completions", json=body).json()
    params = ScriptedBridge.sent[-1].params
    assert params.guided_decoding_guide_type == "json_schema" and json.loads(params.guided_decoding_guide) == schema
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Rome"}')
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and answer["choices"][0]["message"]["content"] is None


def test_required_with_parallel_calls_is_an_array_of_calls(qwen):
    ScriptedBridge.reply = ('[{"name": "get_time", "parameters": {}}, '
                            '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    body = {**CHAT, "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    answer = qwen.post("/v1/chat/completions", json=body).json()
    schema = json.loads(ScriptedBridge.sent[-1].params.guided_decoding_guide)
    assert (schema["type"], schema["minItems"], schema["maxItems"], len(schema["items"]["anyOf"])) == ("array", 1, 8, 2)
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    message, finish = _streamed(qwen.post("/v1/chat/completions", json={**body, "stream": True}))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [(c["function"]["name"], c["function"]["arguments"]) for c in calls] and finish == ["tool_calls"]


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tool_choice": "sometimes"}, "tool_choice", "Input should be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters", "JSON Schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "tools.0.function.parameters",
     "not a JSON Schema trtforge can enforce"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "send one constraint"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls.0.function.arguments", "JSON text"),
    ({"n": 17}, "n", "less than or equal to 16"),
])
def test_malformed_tools_are_a_clear_400(plain, fields, param, words):
    response = plain.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_n_choices_have_their_seeds_share_the_prompt_and_count_all_tokens(plain):
    ScriptedBridge.reply = "abcdef"
    answer = plain.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 5, "n": 3,
                                                 "seed": 2**64 - 2, "temperature": 1}).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and {c["text"] for c in answer["choices"]} == {"abcdef"}
    assert [p.params.seed for p in ScriptedBridge.sent] == [2**64 - 2, 2**64 - 1, 0]
    # The first choice alone until its first response (its prompt is then cached), then the others.
    assert ScriptedBridge.events[:2] == [("sent", 0), ("first", 0)]
    assert sorted(ScriptedBridge.events[2:4]) == [("sent", 1), ("sent", 2)]
    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 3 + 4 + 5, "total_tokens": 21,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    ScriptedBridge.sent.clear()
    plain.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "n": 2})
    assert [p.params.seed for p in ScriptedBridge.sent] == [None, None]


def test_n_choices_stream_with_their_index(plain):
    ScriptedBridge.reply = "abcdef"
    for path, body in [("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 5}),
                       ("/v1/chat/completions", CHAT)]:
        ScriptedBridge.sent.clear()
        response = plain.post(path, json={**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        texts = {i: "" for i in range(3)}
        finished = []
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            texts[choice["index"]] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice["finish_reason"]:
                finished.append(choice["index"])
        assert texts == {0: "abcdef", 1: "abcdef", 2: "abcdef"} and sorted(finished) == [0, 1, 2]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
