"""Mistral's two tool-call formats through the `mistral` parser: `[TOOL_CALLS][{...}, ...]` (pre-v11
tokenizers) and `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later), non-streamed and
streamed split at every character boundary (deltas put together by the openai SDK's accumulator)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frontend.test_tool_parsers import _non_streamed, _reassembled
from trtforge.frontend.tool_parsers import TOOL_CALL_PARSERS
from trtforge.frontend.tool_stream import ToolCallStream

WEATHER = {"city": "Paris", "unit": "celsius"}
# (model output, content, [(name, arguments object)])
V11 = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [("get_weather", WEATHER)]),
    ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]'
     '{"a": 3.5, "b": {"c": [1, 2]}}', "Let me look.",
     [("get_weather", WEATHER), ("add", {"a": 3.5, "b": {"c": [1, 2]}})]),
    # a brace, a bracket and the marker itself inside a string argument are the argument's
    ('[TOOL_CALLS]search[ARGS]{"q": "} [TOOL_CALLS]x[ARGS]{ \\"quoted\\""}', "",
     [("search", {"q": '} [TOOL_CALLS]x[ARGS]{ "quoted"'})]),
    # a decoder that drops the [ARGS] control token (vLLM's mistral_common decoding) writes name{...}
    ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}', "", [("get_weather", WEATHER)]),
    ("[TOOL_CALLS]now[ARGS]{}", "", [("now", {})]),
    ("[TOOL_CALLS]now[ARGS]", "", [("now", {})]),  # no arguments written at all
    ("Plain [ARGS] text, no call.", "Plain [ARGS] text, no call.", []),
    ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),  # cut short before its arguments: no call
]
PRE_V11 = [
    ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "Sure.",
     [("get_weather", WEATHER)]),
    ('[TOOL_CALLS]{"name": "now", "arguments": {}}', "", [("now", {})]),
]
CASES = V11 + PRE_V11


@pytest.mark.parametrize("text, content, calls", CASES)
def test_both_formats_non_streamed(text, content, calls):
    stream = _non_streamed("mistral", text)
    assert stream.content == content
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == calls


@pytest.mark.parametrize("text, content, calls", CASES)
def test_streamed_split_at_every_character_boundary_equals_non_streamed(text, content, calls):
    parser = TOOL_CALL_PARSERS["mistral"]
    whole = _non_streamed("mistral", text)
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]  # every cut, then each char
    for pieces in splits:
        message = _reassembled(parser, pieces)
        assert message.get("content", "") == whole.content, pieces
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert got == [(c.name, c.arguments) for c in whole.calls], pieces


def test_a_v11_name_is_sent_whole_then_its_arguments_grow():
    text = V11[1][0]
    stream = ToolCallStream(TOOL_CALL_PARSERS["mistral"])
    deltas = [d for ch in text for d in stream.feed(ch).calls] + stream.finish().calls
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name, d.arguments) for d in firsts] == [(0, "get_weather", ""), (1, "add", "")]
    assert all(d.arguments for d in deltas if d.id is None)
    assert stream.content == "Let me look."  # nothing of the marker or the name leaked into content


def test_v11_special_tokens_through_the_detokenizer():
    """[TOOL_CALLS] and [ARGS] held as special tokens: kept (skip_special_tokens=false, as the front end
    asks for the mistral parser), the calls are read from the engine's incremental text."""
    from tests.helpers.checkpoints import train_tiny_tokenizer
    from trtforge.frontend.served_model import ServedModel
    from trtforge.serving.detokenizer import IncrementalDetokenizer

    tok = train_tiny_tokenizer(vocab_size=512)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    served = ServedModel(name="m", engine_dir=Path("/nonexistent"), tokenizer=tok, max_seq_len=64,
                         tool_call_parser="mistral")
    assert served.keeps_special_tokens(forced=False)
    answer = 'Ok.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": "z"}'
    ids = tok.encode(answer, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    pieces = [detok.step([t]) for t in ids] + [detok.flush()]
    message = _reassembled(TOOL_CALL_PARSERS["mistral"], pieces)
    assert message.get("content") == "Ok."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("f", {"x": 1}), ("g", {"y": "z"})]
