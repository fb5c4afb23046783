"""Request models of vLLM's POST /tokenize and POST /detokenize."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trtforge.frontend.schemas import INT32_MAX, ChatMessage, Text
from trtforge.frontend.tool_schemas import MAX_TOOLS, Tool, check_unique


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="The served model id (GET /v1/models).")
    prompt: Text | None = Field(None, description="The text to tokenize.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description=(
        "Instead of prompt: a conversation, tokenized as /v1/chat/completions sends it."))
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(None, description=(
        "With messages (as vLLM): the tools offered, rendered as /v1/chat/completions renders them with "
        "tool_choice auto, so that `count` is that request's usage.prompt_tokens."))
    add_special_tokens: bool = Field(False, description=(
        "Add the tokenizer's special tokens (BOS, ...). Default false: what the engine does with a "
        "prompt, so that `count` equals usage.prompt_tokens."))
    return_token_strs: bool = Field(False, description="Also return each token's text.")

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        return check_unique(tools)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools are rendered by the chat template: send them with messages, not with a prompt")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="The served model id (GET /v1/models).")
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(description="Token ids to turn into text.")
