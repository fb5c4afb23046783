"""Typed response models of the OpenAI-compatible API, in OpenAI's shapes.

They document the answers in `/openapi.json` and serialize them; streamed chunks are the same
models written as server-sent events.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


StopReason = int | str | None
"""vLLM's `stop_reason` extension: the stop string, or the stop token id (EOS included), that ended
the choice; null when it ended otherwise (its length)."""


def _avg_decoded_tokens_per_iter() -> Any:
    return Field(None, description=(
        "Extension (trtllm-serve's field): with speculative decoding, the tokens this choice generated per "
        "engine step (1 + the draft tokens accepted per step); null when the engine does not speculate "
        "(and on streamed chunks before the last)."))


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the engine's prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions log-probabilities: one entry per generated token (with echo, the prompt's
    tokens first: the first one's logprob and alternatives null, as OpenAI)."""

    tokens: list[str] = Field(description="The text each token added (see docs/serving.md).")
    token_logprobs: list[float | None]
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None = Field(None, description=(
        "With logprobs=K > 0: per token, its K most likely alternatives (each token's own text: "
        "token text -> log-probability)."))


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's entry at a prompt position."""

    logprob: float
    rank: int = Field(description="1 + the number of tokens more likely than it at this position.")
    decoded_token: str = Field(description="The token's own text (decoded alone).")


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: null for the first prompt token, then per prompt token {token id: entry}
of the token itself and the K most likely there."""


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = None
    avg_decoded_tokens_per_iter: float | None = _avg_decoded_tokens_per_iter()


class Completion(BaseModel):
    """A /v1/completions answer, or one of its streamed chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str = Field(description="The alternative token's own text (decoded alone).")
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str = Field(description="The text this token added (see docs/serving.md).")
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list, description=(
        "The `top_logprobs` most likely tokens at this position, most likely first."))


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as the model wrote them (JSON text).")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: StopReason = None
    avg_decoded_tokens_per_iter: float | None = _avg_decoded_tokens_per_iter()


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class _OmitNone(BaseModel):
    """Serialized without its unset (None) fields: the OpenAI SDK's stream accumulator sets `type`
    from every delta that has the key, so a later `"type": null` would erase the call's type."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_OmitNone):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(_OmitNone):
    """A streamed piece of a tool call: the first one has id, type and name; the others only
    `function.arguments` to append (per `index`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    avg_decoded_tokens_per_iter: float | None = _avg_decoded_tokens_per_iter()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    """POST /tokenize (vLLM's shape)."""

    count: int
    max_model_len: int = Field(description="Prompt + output tokens the engine allows per request.")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trtforge"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, with the HTTP status of its kind (docs/serving.md)."""

    error: ErrorBody
