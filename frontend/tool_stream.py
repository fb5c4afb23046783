"""A choice's text, read as content and tool calls while it streams (and once it has ended).

`ToolCallStream.feed(delta)` re-parses the whole output so far (tool_parsers.py) and returns what
is new since the last call, in the order OpenAI streams it and its SDK reassembles it (deltas are
concatenated per `index`):

* content: the new part of the text before the tool calls;
* a call seen for the first time: `{index, id, type: "function", function: {name, arguments: ""}}`;
* then its arguments as they grow: `{index, function: {arguments: <the new characters>}}`.

`finish()` reads the text once more as final. The non-streamed answer is this same object fed the
whole text at once, so a streamed call and a non-streamed one with the same output are equal
field for field (ids aside: each answer has its own).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from trtforge.frontend.tool_parsers import Parsed, Parser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """One entry of a streamed delta's `tool_calls`."""

    index: int
    arguments: str
    id: str | None = None
    """Only on a call's first delta (with its name)."""
    name: str | None = None


@dataclass
class Update:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallStream:
    """One choice's output through one parser."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""
        """The content sent so far."""
        self.calls: list[ToolCall] = []
        """The calls sent so far, with their arguments so far."""

    def feed(self, delta: str) -> Update:
        self.text += delta
        return self._update(self.parser(self.text, False))

    def finish(self) -> Update:
        return self._update(self.parser(self.text, True))

    def _update(self, parsed: Parsed) -> Update:
        update = Update()
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            update.content = parsed.content[len(self.content):]
            self.content = parsed.content
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls):
                self.calls.append(ToolCall(new_call_id(), call.name, ""))
                update.calls.append(CallDelta(index, "", id=self.calls[index].id, name=call.name))
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                update.calls.append(CallDelta(index, call.arguments[len(sent.arguments):]))
                sent.arguments = call.arguments
        return update
