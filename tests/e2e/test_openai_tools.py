"""Tool calling through `trtforge serve --openai-port`, called with the `openai` SDK.

The e2e engine (random weights) is copied with Qwen 2.5's chat template, which takes tools, and
served by a real tritonserver. With tool_choice required / named the call is enforced by the
grammar: every call must name a given tool and its arguments must validate (jsonschema) against
that tool's schema, at any temperature; a streamed call, put together by the SDK's own stream
state, equals the non-streamed greedy one, and both equal the in-process engine's greedy output
under the same guide. The count of tests here is checked in conftest.EXPECTED_TESTS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.e2e.helpers import engine_with_chat_template
from tests.e2e.openai_server import ServeProcess, start_serve

pytestmark = pytest.mark.e2e

NAME = "tiny-tools"
TEMPLATE = Path(__file__).parents[1] / "frontend" / "qwen2_5_chat_template.jinja"
MAX_TOKENS = 200

# Bounded schemas: a random model meets every bound through the grammar, and no string or array
# can outgrow MAX_TOKENS.
SCHEMAS = {
    "get_weather": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}},
    "place_order": {"type": "object", "required": ["item", "quantity", "gift"], "properties": {
        "item": {"type": "string", "minLength": 1, "maxLength": 8},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99}, "gift": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "blue", "new"]}}}},
    "move_to": {"type": "object", "required": ["point"], "properties": {
        "point": {"type": "object", "required": ["x", "y"], "properties": {
            "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}}},
        "label": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}}},
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}.",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "Plan my trip to Oslo, please."}]


@dataclass
class ToolsApi:
    serve: ServeProcess
    client: openai.OpenAI
    engine: object
    """The in-process LLMEngine on the same engine copy: the oracle."""

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def api(engine_dir, tmp_path_factory):
    from trtforge.serving.engine import LLMEngine

    root = tmp_path_factory.mktemp("openai-tools")
    engine = engine_with_chat_template(engine_dir, root, TEMPLATE)
    serve = start_serve(root / "repo", root / "tritonserver.log", "--served-model-name", NAME)
    try:
        client = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=120)
        yield ToolsApi(serve, client, LLMEngine.from_engine_dir(engine))
    finally:
        assert serve.stop() == 0, "".join(serve.output)


def _check_calls(choice, allowed: set[str]) -> list:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls and choice.message.content is None, choice
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_forced_calls_always_validate_against_their_tool_schema(api):
    """Named (each tool) and required (single and parallel) at three temperatures: every call names a
    given tool and its arguments validate."""
    checked = 0
    for temperature, seed in [(0.0, None), (0.8, 11), (1.5, 12)]:
        common = dict(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=temperature, seed=seed,
                      max_tokens=MAX_TOKENS)
        for name in SCHEMAS:
            answer = api.client.chat.completions.create(
                tool_choice={"type": "function", "function": {"name": name}}, **common)
            (call,) = _check_calls(answer.choices[0], {name})
            checked += 1
        answer = api.client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **common)
        (call,) = _check_calls(answer.choices[0], set(SCHEMAS))
        # Parallel: up to 8 calls (the grammar's bound; greedy decoding of random weights repeats its
        # call until then), so no max_tokens: the rest of the context.
        answer = api.client.chat.completions.create(tool_choice="required", **{**common, "max_tokens": None})
        calls = _check_calls(answer.choices[0], set(SCHEMAS))
        assert 1 <= len(calls) <= 8
        checked += 1 + len(calls)
    assert checked >= 15


def test_a_streamed_call_reassembles_to_the_non_streamed_greedy_one_and_the_engines(api):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from trtforge.config.sampling import SamplingParams
    from trtforge.frontend.tool_schemas import NamedToolChoice, Tool, forced_guide

    for choice in ({"type": "function", "function": {"name": "place_order"}}, "required"):
        common = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0)
        whole = api.client.chat.completions.create(**common)
        calls = _check_calls(whole.choices[0], set(SCHEMAS))
        state = ChatCompletionStreamState()
        chunks = list(api.client.chat.completions.create(stream=True, **common))
        for chunk in chunks:
            state.handle_chunk(chunk)
        streamed = state.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] \
            == [(c.function.name, c.function.arguments) for c in calls]
        # Each call's name came first, alone, then its arguments in pieces.
        deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls
                  for d in c.choices[0].delta.tool_calls]
        assert deltas[0].id and deltas[0].function.name == calls[0].function.name and not deltas[0].function.arguments
        assert len(deltas) > len(calls) + 1 and all(d.id is None for d in deltas if d.function.name is None)
        # The engine, on the prompt the template makes with the tools, under the same grammar.
        guide_type, guide = forced_guide([Tool.model_validate(t) for t in TOOLS], choice if isinstance(choice, str)
                                         else NamedToolChoice.model_validate(choice), True)
        prompt = api.prompt(MESSAGES, TOOLS)
        used = len(api.engine.tokenizer.encode(prompt, add_special_tokens=False))
        room = api.engine.scheduler_config.max_seq_len - used
        (want,) = api.engine.generate([prompt], SamplingParams(  # no max_tokens: the rest of the context, as the API
            max_tokens=room, guided_decoding_guide_type=guide_type, guided_decoding_guide=guide))
        value = json.loads(want.text)
        expected = [value] if isinstance(value, dict) else value
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] \
            == [(e["name"], e["parameters"]) for e in expected]
        assert whole.usage.completion_tokens == len(want.output_token_ids)


def test_auto_tools_and_a_tool_call_history_go_through_the_template(api):
    """The prompt is the chat template's, with the tools and with an assistant's calls and a tool's
    result (usage.prompt_tokens equals the template's rendering); auto leaves the model free."""
    from trtforge.config.sampling import SamplingParams

    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_7", "content": "4 C, rain"}]
    answer = api.client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, temperature=0,
                                                max_tokens=12)
    oracle_history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
                      {"role": "tool", "tool_call_id": "call_7", "content": "4 C, rain"}]
    prompt = api.prompt(oracle_history, TOOLS)
    assert "<tool_response>\n4 C, rain\n</tool_response>" in prompt and '"name": "place_order"' in prompt
    (want,) = api.engine.generate([prompt], SamplingParams(max_tokens=12))
    assert answer.usage.prompt_tokens == len(api.engine.tokenizer.encode(prompt, add_special_tokens=False))
    choice = answer.choices[0]
    # Random weights write no <tool_call>: the text is the engine's, unparsed.
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) \
        == (want.text, None, want.finish_reason)


def test_malformed_tools_are_a_clear_400(api):
    bad = [
        (dict(tools=TOOLS + TOOLS[:1]), "'get_weather' is given twice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
         "'fly', which is not in tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}]),
         "not a JSON Schema trtforge can enforce"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "JSON Schema of an object"),
        (dict(tool_choice="required"), 'tool_choice "required" needs tools'),
    ]
    for fields, words in bad:
        with pytest.raises(openai.BadRequestError, match=words):
            api.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, **fields)
    # The server is fine after them.
    answer = api.client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    _check_calls(answer.choices[0], set(SCHEMAS))


def test_n_choices_with_forced_calls_each_validate(api):
    answer = api.client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, n=3, seed=5, temperature=1.0,
                                                max_tokens=MAX_TOKENS)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        _check_calls(choice, set(SCHEMAS))
