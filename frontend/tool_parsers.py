"""Tool calls in a model's output, per model family: `--tool-call-parser` (vLLM's names).

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after
  optional text (Hermes, Qwen 2 / 2.5 / 3, and the fallback prompt of tool_prompt.py);
* `llama3_json`: `{"name": ..., "parameters": {...}}` as the whole answer, optionally after
  `<|python_tag|>`, several joined by `;` (Llama 3.1 / 3.2 / 3.3);
* `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional text (Mistral,
  Mixtral with v3 tokenizers), or, from v11 tokenizers on (Mistral Small 3.2, Devstral, ...),
  `[TOOL_CALLS]name[ARGS]{...}` once per call; the text after the marker says which.

`forced` is not a model's format but the grammar's (tool_schemas.forced_guide): with
`tool_choice` required or named the engine can only write a call object `{"name": ...,
"parameters": {...}}` or an array of them, and this parser reads it whatever the family.

Each parser reads the output so far, `parse(text, final)`: the content before the tool calls, and
each call whose name is complete with the raw text of its arguments so far (tool_stream.py turns
successive parses into streamed deltas). While not final, text that may still become a call is
held back (the start of a `<tool_call>` marker; a Llama answer that starts with `{`). A final text
in which no call has a name is all content. Arguments are the JSON text the model wrote (a JSON
string holding the arguments is decoded), so a streamed call reassembles to exactly the
non-streamed one; they are not re-validated: a call cut short by max_tokens keeps its partial
arguments and the choice's finish_reason says "length".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from trtforge.frontend.partial_json import object_members, skip_ws, string_at

ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys a call object's arguments come under (Hermes/Mistral write `arguments`, Llama `parameters`)."""


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """The arguments' JSON text so far."""
    complete: bool


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


Parser = Callable[[str, bool], Parsed]


def call_at(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The call object opening at text[i] ('{'): (the call, None until its name is complete; the
    index past the object, None while it is open)."""
    members, end = object_members(text, i)
    name, arguments, seen_arguments = None, "", False
    for m in members:
        if m.key == "name" and m.end is not None:
            name = string_at(text, m.start)
        elif m.key in ARGUMENT_KEYS and not seen_arguments:
            seen_arguments = True
            raw = text[m.start:len(text) if m.end is None else m.end]
            if raw.startswith('"'):  # arguments as a JSON string: its text, once it is closed
                arguments = (string_at(text, m.start) or "") if m.end is not None else ""
            else:
                arguments = raw
    if end is not None and not seen_arguments:
        arguments = "{}"
    return (None if name is None else ParsedCall(name, arguments, end is not None)), end


def calls_at(text: str, j: int) -> list[ParsedCall | None]:
    """The call object, or the array of call objects, starting at text[j]; None entries are
    objects without a (complete) name."""
    if j >= len(text):
        return []
    if text[j] == "{":
        return [call_at(text, j)[0]]
    if text[j] != "[":
        return []
    calls: list[ParsedCall | None] = []
    k = skip_ws(text, j + 1)
    while k < len(text) and text[k] == "{":
        call, end = call_at(text, k)
        calls.append(call)
        if end is None:
            break
        k = skip_ws(text, end)
        if k >= len(text) or text[k] != ",":
            break
        k = skip_ws(text, k + 1)
    return calls


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _named(calls: list[ParsedCall | None]) -> list[ParsedCall]:
    return [c for c in calls if c is not None]


def _content_until(text: str, marker: str, final: bool) -> Parsed:
    """No marker yet: all content, less a possible start of the marker at the end."""
    return Parsed(text if final else text[:len(text) - _partial_marker(text, marker)])


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> Parsed:
    first = text.find(HERMES_START)
    if first < 0:
        return _content_until(text, HERMES_START, final)
    calls: list[ParsedCall | None] = []
    at = first
    while at >= 0:
        j = skip_ws(text, at + len(HERMES_START))
        if j >= len(text) or text[j] != "{":
            break
        call, end = call_at(text, j)
        calls.append(call)
        if end is None:
            break
        at = text.find(HERMES_START, end)
    named = _named(calls)
    if final and not named:
        return Parsed(text)
    return Parsed(text[:first], named)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> Parsed:
    j = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, j):
        j = skip_ws(text, j + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[j:]):
        return Parsed("")  # nothing yet, or the start of the tag: undecided
    if j >= len(text):
        return Parsed(text if final else "")
    if text[j] != "{":
        return Parsed(text) if j == skip_ws(text, 0) or final else Parsed("")
    calls: list[ParsedCall | None] = []
    while j < len(text) and text[j] == "{":
        call, end = call_at(text, j)
        calls.append(call)
        if end is None:
            break
        k = skip_ws(text, end)
        if k >= len(text) or text[k] != ";":
            break
        j = skip_ws(text, k + 1)
    named = _named(calls)
    if final and not named:
        return Parsed(text)
    return Parsed("", named)


MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"


def _v11_call(text: str, i: int, final: bool) -> tuple[ParsedCall | None, int | None]:
    """The v11 call `name[ARGS]{...}` (or `name{...}`, as a decoder that drops [ARGS] writes it)
    starting at text[i], just past its [TOOL_CALLS]: (the call, None until its name is complete;
    the index past its arguments, None while they are open)."""
    brace, args = text.find("{", i), text.find(MISTRAL_ARGS, i)
    if args >= 0 and (brace < 0 or args < brace):
        name, j = text[i:args], skip_ws(text, args + len(MISTRAL_ARGS))
    elif brace >= 0:
        name, j = text[i:brace], brace
    else:
        return None, None  # the name may go on (or be cut short: no call)
    name = name.strip()
    if not name:
        return None, None
    if j < len(text) and text[j] == "{":
        _, end = object_members(text, j)
        if end is not None:
            return ParsedCall(name, text[j:end], True), end
        return ParsedCall(name, text[j:], False), None
    return _v11_other_arguments(text, name, j, final)


def _v11_other_arguments(text: str, name: str, j: int, final: bool) -> tuple[ParsedCall, int | None]:
    """Arguments that are not an object: whatever the model wrote up to the next call (or the end),
    sent once it is known where they end."""
    rest = text[j:]
    cut = rest.find(MISTRAL_MARKER)
    if cut >= 0:
        return ParsedCall(name, rest[:cut].strip() or "{}", True), j + cut
    if not final:
        return ParsedCall(name, "", False), None
    return ParsedCall(name, rest.strip() or "{}", True), len(text)


def _parse_mistral_v11(text: str, content: str, at: int, final: bool) -> Parsed:
    """`content[TOOL_CALLS]name1[ARGS]{args1}[TOOL_CALLS]name2[ARGS]{args2}` (v11 tokenizers), `at`
    the first marker."""
    calls: list[ParsedCall | None] = []
    while at >= 0:
        call, end = _v11_call(text, at + len(MISTRAL_MARKER), final)
        calls.append(call)
        if end is None:
            break
        at = text.find(MISTRAL_MARKER, end)
    named = _named(calls)
    if final and not named:
        return Parsed(text)
    return Parsed(content, named)


def parse_mistral(text: str, final: bool) -> Parsed:
    """Both Mistral formats, told apart by what follows the marker: a JSON array or object (pre-v11
    tokenizers) or a function name (v11 and later)."""
    marker = text.find(MISTRAL_MARKER)
    if marker >= 0:
        content, j = text[:marker], skip_ws(text, marker + len(MISTRAL_MARKER))
        if j >= len(text):
            return Parsed(text if final else content)
        if text[j] not in "[{":
            return _parse_mistral_v11(text, content, marker, final)
    else:
        # The marker is a special token: the front end asks for it to be kept
        # (skip_special_tokens=false, ServedModel.keeps_special_tokens); an answer that is a JSON
        # array of call objects (a server that skipped it) is read as calls too.
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return _content_until(text, MISTRAL_MARKER, final) if j < len(text) or final else Parsed("")
        content = ""
    named = _named(calls_at(text, j))
    if final and not named:
        return Parsed(text)
    return Parsed(content, named)


def parse_forced(text: str, final: bool) -> Parsed:
    """The grammar's own output (tool_choice required / named): a call object or an array of them."""
    return Parsed("", _named(calls_at(text, skip_ws(text, 0))))


TOOL_CALL_PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
"""`--tool-call-parser` choices."""

PARSER_MARKERS = {"hermes": HERMES_START, "llama3_json": PYTHON_TAG, "mistral": MISTRAL_MARKER}
"""The marker each parser reads. Where the tokenizer holds it as a special token the engine must
not skip special tokens, or the marker never reaches the parser (ServedModel.keeps_special_tokens)."""

_TEMPLATE_MARKERS = ((HERMES_START, "hermes"), (MISTRAL_MARKER, "mistral"), (PYTHON_TAG, "llama3_json"),
                     ("ipython", "llama3_json"))


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format calls for; `hermes` when it names none
    (a template without tool support gets the Hermes-format instructions of tool_prompt.py)."""
    for marker, name in _TEMPLATE_MARKERS:
        if template and marker in template:
            return name
    return "hermes"
