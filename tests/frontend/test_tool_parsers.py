"""Tool-call parsers on the formats real models write, streamed in any split: the deltas, put together
by the `openai` SDK's own accumulator, equal the non-streamed calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from openai.lib.streaming._deltas import accumulate_delta

from trtforge.frontend.partial_json import object_members, value_end
from trtforge.frontend.tool_parsers import TOOL_CALL_PARSERS, parse_forced, parser_for_template
from trtforge.frontend.tool_stream import ToolCallStream

# (parser, model output as the model family writes it, content, [(name, arguments object)])
OUTPUTS = [
    # Qwen 2.5 (its chat template's format), with text before the call
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_current_temperature", "arguments": '
               '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
     "Let me check.\n", [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    # Hermes 2 Pro: arguments before the name, two calls
    ("hermes", '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {"q": "a \\"quoted\\" } brace"}, "name": "search"}\n</tool_call>',
     "", [("get_stock_fundamentals", {"symbol": "TSLA"}), ("search", {"q": 'a "quoted" } brace'})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    # Llama 3.1 JSON tool calling, with and without <|python_tag|>
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                    '"unit": "Fahrenheit"}}',
     "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}',
     "", [("a", {"x": [1, 2]}), ("b", {})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    # Mistral 7B v0.3 / Mixtral: the marker, then a JSON array
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                '"format": "celsius"}}]',
     "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    # ... the marker skipped as a special token by the detokenizer
    ("mistral", '[{"name": "f", "arguments": {"n": 1}}, {"name": "g", "arguments": {"n": 2.5e3}}]',
     "", [("f", {"n": 1}), ("g", {"n": 2500.0})]),
    ("mistral", "Plain answer [1] with a bracket.", "Plain answer [1] with a bracket.", []),
    # arguments as a JSON string (some fine-tunes write them so)
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
]


def _non_streamed(parser: str, text: str):
    stream = ToolCallStream(TOOL_CALL_PARSERS[parser])
    stream.feed(text)
    stream.finish()
    return stream


@pytest.mark.parametrize("parser, text, content, calls", OUTPUTS)
def test_parsers_read_real_model_formats(parser, text, content, calls):
    stream = _non_streamed(parser, text)
    assert stream.content == content
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == calls
    assert len({c.id for c in stream.calls}) == len(calls)


def _reassembled(parser, pieces: list[str]) -> dict:
    """The chunks' deltas, as dicts, accumulated by the openai SDK's accumulate_delta."""
    stream = ToolCallStream(parser)
    message: dict = {}
    updates = [stream.feed(p) for p in pieces] + [stream.finish()]
    for update in updates:
        if update.content:
            accumulate_delta(message, {"content": update.content})
        for d in update.calls:
            entry = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                entry.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
            accumulate_delta(message, {"tool_calls": [entry]})
    return message


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 400), max_size=12))
def test_streamed_deltas_reassemble_to_the_non_streamed_calls(output, cuts):
    parser, text, content, calls = output
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    message = _reassembled(TOOL_CALL_PARSERS[parser], pieces)
    whole = _non_streamed(parser, text)
    assert message.get("content", "") == whole.content
    got = [(c["function"]["name"], c["function"]["arguments"], c["type"]) for c in message.get("tool_calls", [])]
    assert got == [(c.name, c.arguments, "function") for c in whole.calls]


def test_one_character_at_a_time_sends_the_name_first_then_growing_arguments():
    text = OUTPUTS[0][1]
    stream = ToolCallStream(TOOL_CALL_PARSERS["hermes"])
    deltas = [d for ch in text for d in stream.feed(ch).calls] + stream.finish().calls
    assert deltas[0].id and deltas[0].name == "get_current_temperature" and deltas[0].arguments == ""
    assert all(d.id is None and d.name is None and d.arguments for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == stream.calls[0].arguments


def test_the_forced_format_and_a_call_cut_short():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "x}"}}]'
    parsed = parse_forced(text, True)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] \
        == [("f", {"a": 1}, True), ("g", {"b": "x}"}, True)]
    cut = parse_forced('{"name": "f", "parameters": {"a": [1, 2', True)
    assert [(c.name, c.arguments, c.complete) for c in cut.calls] == [("f", '{"a": [1, 2', False)]


def test_partial_json_scanning():
    assert value_end('{"a": "}"} tail', 0) == 10 and value_end('{"a": "}', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2 and value_end('"x\\"y"', 0) == 6
    members, end = object_members('{"a": 1, "b": {"c": [', 0)
    assert [(m.key, m.end is None) for m in members] == [("a", False), ("b", True)] and end is None


@pytest.mark.parametrize("template, parser", [
    ("... <tool_call>\\n{\"name\": ... </tool_call>", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }} ... [TOOL_CALLS]", "mistral"),
    ("{%- if builtin_tools %}<|python_tag|>", "llama3_json"),
    ("{{ message['content'] }}", "hermes"), (None, "hermes"),
])
def test_the_default_parser_follows_the_chat_template(template, parser):
    assert parser_for_template(template) == parser


@pytest.mark.parametrize("parser, marker, answer", [
    ("mistral", "[TOOL_CALLS]", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'),
    ("llama3_json", "<|python_tag|>", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}'),
])
def test_a_special_token_marker_reaches_the_parser_with_skip_special_tokens_false(parser, marker, answer):
    """Where the tokenizer holds the parser's marker as a special token, the engine's detokenizer
    would drop it (skip_special_tokens, the default): the front end then asks to keep special tokens."""
    from pathlib import Path

    from tests.helpers.checkpoints import train_tiny_tokenizer
    from trtforge.frontend.served_model import ServedModel
    from trtforge.serving.detokenizer import IncrementalDetokenizer

    tok = train_tiny_tokenizer(vocab_size=512)
    plain = ServedModel(name="m", engine_dir=Path("/nonexistent"), tokenizer=tok, max_seq_len=64,
                        tool_call_parser=parser)
    assert not plain.keeps_special_tokens(forced=False)  # the marker is plain text to this tokenizer
    tok.add_special_tokens({"additional_special_tokens": [marker]})
    served = ServedModel(name="m", engine_dir=Path("/nonexistent"), tokenizer=tok, max_seq_len=64,
                         tool_call_parser=parser)
    assert served.keeps_special_tokens(forced=False) and not served.keeps_special_tokens(forced=True)
    ids = tok.encode(answer, add_special_tokens=False)
    assert tok.convert_tokens_to_ids(marker) in ids

    def streamed(skip: bool) -> str:
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        return "".join(detok.step([t]) for t in ids) + detok.flush()

    kept = TOOL_CALL_PARSERS[parser](streamed(False), True)
    assert [(c.name, json.loads(c.arguments)) for c in kept.calls] == [("f", {"x": 1})]
    assert marker not in streamed(True)
    if parser == "mistral":
        assert kept.content == "Sure."
        skipped = TOOL_CALL_PARSERS[parser](streamed(True), True)  # "Sure.[{...}]": the marker is gone
        assert not skipped.calls
