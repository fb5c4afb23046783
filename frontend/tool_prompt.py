"""A conversation with tools, as the chat template reads it.

A template that takes tools (its source uses the `tools` variable: Qwen 2.5, Hermes, Llama 3.1,
Mistral's, ...) gets them as transformers passes them, `apply_chat_template(messages,
tools=[...])`, and the history in transformers' shape: an assistant message's `tool_calls` with
their arguments as a mapping, `role: "tool"` messages with their `tool_call_id`.

A template without tool support would drop the tools silently. For it the tools go into the
system prompt (the first system message, or a new one), in the words of the tool-call format the
server parses (`--tool-call-parser`; Hermes' `<tool_call>` by default, as Qwen's and Hermes'
templates write it), and the history is written in that format too: an assistant's calls as its
text, a tool result as a user message in `<tool_response>` tags.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from trtforge.frontend.schemas import ChatMessage
from trtforge.frontend.tool_schemas import Tool

_FORMATS = {
    "hermes": ("For each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\n</tool_call>"),
    "llama3_json": ("To call a function, respond with only a JSON object of the form {\"name\": "
                    "<function-name>, \"parameters\": <args-json-object>}; several calls are joined by \"; \"."),
    "mistral": ("To call functions, respond with [TOOL_CALLS] followed by a JSON array of "
                "{\"name\": <function-name>, \"arguments\": <args-json-object>} objects."),
}


def template_source(tokenizer: Any, with_tools: bool) -> str | None:
    """The template transformers applies (a dict of named templates: `tool_use` when tools are
    given and it has one, else `default`)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") if with_tools and "tool_use" in template else template.get("default")
    return template


@functools.lru_cache(maxsize=8)
def template_takes_tools(template: str | None) -> bool:
    """The template reads the `tools` variable (else it would drop them)."""
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return "tools" in template


def tools_text(tools: list[Tool], parser: str) -> str:
    """The system-prompt text that describes the tools to a template without tool support."""
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
            f"</tools>\n\n{_FORMATS.get(parser, _FORMATS['hermes'])}")


def _calls_text(message: ChatMessage, parser: str) -> str:
    calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
             for c in message.tool_calls or []]
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps(calls)
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def _native(message: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                             "content": message.text()}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [c.for_template() for c in message.tool_calls]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _in_text(message: ChatMessage, parser: str) -> dict[str, Any]:
    """A message for a template that knows nothing of tools."""
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    entry = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        calls = _calls_text(message, parser)
        entry["content"] = f"{entry['content']}\n{calls}" if entry["content"] else calls
    return entry


def conversation(messages: list[ChatMessage], tools: list[Tool] | None, native: bool,
                 parser: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages, the `tools` argument) for apply_chat_template. `tools` None: none are offered
    (tool_choice none); `native`: the template takes tools itself."""
    if native:
        offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        return [_native(m) for m in messages], offered
    flat = [_in_text(m, parser) for m in messages]
    if tools:
        text = tools_text(tools, parser)
        if flat and flat[0]["role"] == "system":
            flat[0] = {**flat[0], "content": f"{flat[0]['content']}\n\n{text}" if flat[0]["content"] else text}
        else:
            flat.insert(0, {"role": "system", "content": text})
    return flat, None
