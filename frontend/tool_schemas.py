"""Tools in a chat request: their typed models, their checks, and the grammar that enforces a call.

`tool_choice` none / auto / required / named (OpenAI's). With required or named, the call is not
left to the model: the request is sent with a JSON Schema guide (the structured-output path,
`guided_decoding_guide_type=json_schema`) that admits only a call object

    {"name": "<a tool's name>", "parameters": <valid against that tool's parameters schema>}

(named: that tool's; required: any tool's, an `anyOf` over them) — or, when
`parallel_tool_calls` is not false, an array of 1 to MAX_PARALLEL_TOOL_CALLS of them. The engine's sampler then
cannot write anything else, so even a model that was never taught tools (random weights
included) returns a call whose arguments validate; tool_parsers.parse_forced reads it back.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from trtforge.frontend.errors import bad_request

MAX_TOOLS = 128
"""Most tools per request (OpenAI's limit)."""
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
"""A function name: letters, digits, `_`, `.`, `-`, 1 to 64 characters (OpenAI's, with `.`)."""
MAX_PARALLEL_TOOL_CALLS = 8
"""Most calls the grammar of tool_choice required admits with parallel_tool_calls (so that a model
that repeats itself, as greedy decoding of a weak model does, still ends its array)."""
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters of a function that declares none: an empty object."""


def _object_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is None:
        return None
    if schema.get("type", "object") != "object":
        raise ValueError(f'a function\'s parameters must be a JSON Schema of an object ("type": "object"), '
                         f'not of type {schema.get("type")!r}')
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"parameters are not JSON ({exc})") from None
    return schema


class FunctionDefinition(BaseModel):
    """`tools[].function`."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME, description="The function's name (what a call names).")
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(_object_schema)] = Field(None, description=(
        "A JSON Schema of the arguments object; left out: the function takes none."))
    strict: bool | None = Field(None, description=(
        "Calls forced by tool_choice required / named always follow the schema; auto calls are the model's."))

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly this tool."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = Field(description="The arguments as JSON text (an object).")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"a tool call's arguments must be JSON text ({exc}): {arguments[:80]!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"a tool call's arguments must be a JSON object, not {type(value).__name__}")
        return arguments


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history (`messages[].tool_calls[]`)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a call (transformers' convention: the arguments as a mapping)."""
        return {**({"id": self.id} if self.id else {}), "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


def check_unique(tools: list[Tool] | None) -> list[Tool] | None:
    """Duplicate names, as a pydantic ValueError."""
    names = [t.function.name for t in tools or []]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"function names must be unique; {', '.join(map(repr, twice))} is given twice")
    return tools


def check_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice | None:
    """A tool_choice that names what is not there, as a pydantic ValueError."""
    names = [t.function.name for t in tools or []]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                         f"({', '.join(map(repr, names)) or 'none given'})")
    if choice == "required" and not names:
        raise ValueError('tool_choice "required" needs tools')
    return choice


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of one call object of `tool`."""
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "parameters": tool.function.parameters_schema()},
            "required": ["name", "parameters"], "additionalProperties": False}


def forced_guide(tools: list[Tool], choice: ToolChoice, parallel: bool) -> tuple[str, str]:
    """The json_schema guide that enforces tool_choice required / named."""
    if isinstance(choice, NamedToolChoice):
        (tool,) = [t for t in tools if t.function.name == choice.function.name]
        return "json_schema", json.dumps(call_schema(tool))
    calls = [call_schema(t) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_TOOL_CALLS, "items": one} if parallel else one
    return "json_schema", json.dumps(schema)


_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    import xgrammar as xgr  # only requests with tools import it (the engine's own grammar library)

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        return _XGRAMMAR_LOCATION.sub("", str(exc).strip()).strip() or type(exc).__name__
    return None


def check_schemas(tools: list[Tool]) -> None:
    """400 for a parameters schema the grammar could not enforce (`"type": "nonsense"`, a minimum
    above its maximum, ...), whatever the tool_choice: the client learns now, not at the first call
    it forces. Slow at its first call (xgrammar's import): run it off the event loop."""
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        problem = _schema_problem(json.dumps(tool.function.parameters, sort_keys=True))
        if problem is not None:
            raise bad_request(f"tools[{i}].function.parameters ({tool.function.name!r}) is not a JSON Schema "
                              f"trtforge can enforce: {problem}", param=f"tools.{i}.function.parameters",
                              code="invalid_tool_schema")
