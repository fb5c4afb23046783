"""Typed request and response models of the OpenAI-compatible API (pydantic v2).

FastAPI validates every request body against these models and generates the OpenAPI schema
(`/openapi.json`) from them; nothing parses JSON by hand. Bounds are those the ensemble accepts
(INT32 `max_tokens`, UINT64 `seed`, penalties in [-2, 2]) so a value out of range is a 400 here
rather than an overflow further down. Unknown fields are ignored, as OpenAI clients send fields
trtforge has no use for (`user`, `metadata`, ...); fields we know but cannot honour are refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from trtforge.frontend.tool_schemas import (
    MAX_TOOLS,
    MessageToolCall,
    NamedToolChoice,
    Tool,
    ToolChoice,
    check_choice,
    check_unique,
    forced_guide,
)

INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (OpenAI's chat limit and vLLM's default max_logprobs; the engine's
SamplingParams bound)."""
MAX_CHOICES_N = 16
"""Most choices per request (`n`): each is one engine request, with its own KV blocks past the shared
prompt blocks."""
MAX_CACHE_SALT_CHARS = 256
"""Longest `cache_salt` a client may send (the engine's bound, 512, leaves room for an API key's
salt in front of it)."""


def _utf8(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they cannot be sent to Triton as UTF-8 bytes.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
"""A string that can be sent to Triton (UTF-8 encodable)."""

StopString = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_utf8)]
PromptText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
"""A completions prompt: the engine needs at least one token."""


def _only(value: Any) -> dict[str, Any]:
    """JSON-schema bounds admitting only `value` for a field whose validator explains why (the
    schema then documents the limit; the error message stays ours)."""
    return {"minimum": value, "maximum": value}


def _finite(lo: float, hi: float, doc: str) -> Any:
    return Field(None, ge=lo, le=hi, allow_inf_nan=False, description=doc)


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` has an effect."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


Guide = tuple[str | None, str | None]
"""(guided_decoding_guide_type, guided_decoding_guide): what the ensemble's structured-output inputs
receive; (None, None) for free text."""
MAX_CHOICES = 256
"""Most alternatives of `structured_outputs.choice`."""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`: each alternative a string literal, escaped
    as JSON escapes strings, which is how xgrammar's EBNF reads a literal too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint on the generated text."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | Text | None = Field(None, alias="json", description=(
        "A JSON Schema (object, or its JSON text) the output must be valid against."))
    regex: Annotated[str, Field(min_length=1), AfterValidator(_utf8)] | None = Field(
        None, description="A regular expression the whole output must match.")
    choice: Annotated[list[Annotated[str, Field(min_length=1), AfterValidator(_utf8)]],
                      Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description=f"The output is exactly one of these strings (at most {MAX_CHOICES}).")
    grammar: Annotated[str, Field(min_length=1), AfterValidator(_utf8)] | None = Field(
        None, description="An EBNF grammar (xgrammar / GBNF style, rule `root`) the output follows.")
    json_object: bool | None = Field(None, description="true: the output is any JSON object.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object "
                             f"(got {', '.join(given) or 'none'})")
        return self

    def guide(self) -> Guide:
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return "json_schema", schema
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "ebnf_grammar", choice_grammar(self.choice)
        if self.grammar is not None:
            return "ebnf_grammar", self.grammar
        return "json", None


class SamplingFields(BaseModel):
    """What completions and chat completions share: the model and how to sample."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="The served model id (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="Most tokens to generate.")
    temperature: float | None = _finite(0.0, 2.0, "0 = greedy (the default).")
    top_p: float | None = _finite(0.0, 1.0, "Nucleus sampling; 1 = off, 0 = most likely token.")
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX,
                              description="Extension (as vLLM): keep the k most likely tokens; "
                                          "0 or -1 = off.")
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX,
                                   description="Extension (as vLLM): generate at least this many "
                                               "tokens (EOS and stop strings wait); <= max_tokens.")
    ignore_eos: bool | None = Field(False, description=(
        "Extension (as vLLM): generate exactly max_tokens tokens (sent as min_tokens = "
        "max_tokens; a stop string still ends the text)."))
    seed: int | None = Field(None, ge=0, le=UINT64_MAX,
                             description="Per-request generator: reproducible sampling.")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings; the text ends before the first.")
    presence_penalty: float | None = _finite(-2.0, 2.0, "In [-2, 2].")
    frequency_penalty: float | None = _finite(-2.0, 2.0, "In [-2, 2].")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES_N, description=(
        f"Choices to generate (1..{MAX_CHOICES_N}), each sampled on its own (with a seed: seed + its "
        "index); they share the prompt's cached KV blocks."))
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (must be empty).",
                                                json_schema_extra={"maxProperties": 0})
    user: str | None = None
    cache_salt: CacheSalt | None = Field(None, description=(
        "Extension (as vLLM): the request's prefix-cache namespace; requests with different "
        f"salts never share cached prompt blocks. 1 to {MAX_CACHE_SALT_CHARS} characters."))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "Extension (as vLLM): constrain the output to a JSON Schema, a regex, one of several choices "
        "or an EBNF grammar (docs/serving.md, Structured output)."))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Extension (vLLM's): the log-probability of every prompt token after the first, and the "
        f"0..{MAX_TOP_LOGPROBS} most likely tokens at each position: the answer's `prompt_logprobs` "
        "(a list, null first, then {token id: {logprob, rank, decoded_token}} per prompt token). "
        "Not with stream=true (as vLLM). Such a request computes its whole prompt (no prefix-cache hit)."))
    skip_special_tokens: bool | None = Field(True, description=(
        "Extension (vLLM's): false keeps special tokens (EOS, chat and tool markers) in the text."))
    speculative: bool | None = Field(None, description=(
        "Extension (trtforge's; vLLM has none): false opts this request out of the engine's speculative "
        "decoding (it decodes one token per step while others speculate; greedy output is the same either "
        "way). Left out: the engine decides (docs/speculative-decoding.md)."))

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "SamplingFields":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream=true (as vLLM): send stream=false")
        return self

    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives the engine computes per prompt position (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def num_top_logprobs(self) -> int:
        """Most likely alternatives asked for per generated token (0: none)."""
        return 0

    def wants_logprobs(self) -> bool:
        """The client asked for the log-probabilities of the generated tokens."""
        return False

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported by trtforge; leave it out")
        return bias

    def num_choices(self) -> int:
        return self.n or 1

    def stop_list(self) -> list[str]:
        """`stop` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def guide(self) -> Guide:
        """The structured-output constraint of this request (the ensemble's guided_decoding inputs)."""
        return self.structured_outputs.guide() if self.structured_outputs is not None else (None, None)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1)] = Field(
        description="One text prompt (a list holding one string is accepted too).")
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX,
                                   description="Most tokens to generate (OpenAI's default, 16).")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "The log-probability of each generated token, and this many most likely alternatives "
        f"(0..{MAX_TOP_LOGPROBS}: OpenAI allows 5, vLLM 20)."))
    echo: bool | None = Field(False, description=(
        "true: the prompt text comes first in the answer's text; with logprobs, the prompt's tokens "
        "come first in `logprobs` too (the first one's logprob null, as OpenAI)."))
    best_of: int | None = Field(None, json_schema_extra=_only(1), description="Only 1.")
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0},
                               description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, prompt: Any) -> Any:
        # Before type checks, so that a batch or token ids get this message, not a union error.
        if isinstance(prompt, list) and (len(prompt) != 1 or not isinstance(prompt[0], str)):
            raise ValueError("send one text prompt (a string, or a list of one string); "
                             "batches and token-id prompts are not supported")
        return prompt

    def echoes_logprobs(self) -> bool:
        """echo=true with logprobs: the prompt's tokens lead `logprobs`."""
        return bool(self.echo) and self.logprobs is not None

    def engine_prompt_logprobs(self) -> int | None:
        if not self.echoes_logprobs():
            return self.prompt_logprobs
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @field_validator("best_of", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        harmless = {"best_of": (None, 1), "suffix": (None, "")}
        if not any(value is ok or (type(value) is type(ok) and value == ok)
                   for ok in harmless[info.field_name]):
            raise ValueError(f"{info.field_name}={value!r} is not supported by trtforge; "
                             "leave it out")
        return value

    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt


class TextPart(BaseModel):
    """A text part of a message's content (the only kind a text model reads)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description=(
        "An assistant message's tool calls (rendered through the chat template)."))
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must be valid against."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, description="The schema's name (not used).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        "A JSON Schema object; left out: any JSON object."))
    strict: bool | None = Field(None, description=(
        "The schema is always enforced (as strict=true): no properties beyond the schema's."))


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = Field(description=(
        "text (free text), json_object (any JSON object) or json_schema (the `json_schema` field's)."))
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format type "json_schema" needs its json_schema: '
                             '{"name": ..., "schema": {...}}')
        return self

    def guide(self) -> Guide:
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.schema_ is None):
            return "json", None
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema.schema_)
        return None, None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description=(
        "Most tokens to generate (wins over max_tokens). Default: up to the context length."))
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        f"0..{MAX_TOP_LOGPROBS} most likely alternatives per generated token; needs logprobs=true."))
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(None, description=(
        f"Functions the model may call (at most {MAX_TOOLS}); offered through the chat template."))
    tool_choice: ToolChoice | None = Field(None, description=(
        'none, auto (the default with tools), required (at least one call) or {"type": "function", '
        '"function": {"name": ...}}; required and named calls are enforced by a grammar.'))
    parallel_tool_calls: bool | None = Field(None, description=(
        "With tool_choice required: true (the default) lets the model make several calls, false exactly one."))
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: Any) -> int | None:
        if top and not info.data.get("logprobs"):  # logprobs is declared (validated) first
            raise ValueError(f"top_logprobs={top} needs logprobs=true (as OpenAI's API)")
        return top

    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        return check_unique(tools)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, choice: ToolChoice | None, info: Any) -> ToolChoice | None:
        return check_choice(info.data.get("tools"), choice)  # tools is declared (validated) first

    @model_validator(mode="after")
    def _one_constraint(self) -> "ChatCompletionRequest":
        constraints = [name for name, given in (
            ("response_format", self.response_format is not None and self.response_format.type != "text"),
            ("structured_outputs", self.structured_outputs is not None),
            (f"tool_choice {self.tool_choice_mode()}", self.forces_tool_call())) if given]
        if len(constraints) > 1:
            raise ValueError(f"send one constraint on the output, not {' and '.join(constraints)}")
        return self

    def tool_choice_mode(self) -> str:
        """none, auto, required or named (auto when tools are given without a choice)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def offered_tools(self) -> list[Tool] | None:
        """The tools the prompt offers (none with tool_choice none)."""
        return self.tools if self.tools and self.tool_choice_mode() != "none" else None

    def forces_tool_call(self) -> bool:
        return self.tool_choice_mode() in ("required", "named")

    def guide(self) -> Guide:
        if self.forces_tool_call():
            return forced_guide(self.tools or [], self.tool_choice, self.parallel_tool_calls is not False)
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.guide()
        return super().guide()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
