"""POST /v1/chat/completions: the chat template, tools, and `n` choices.

The messages (with an assistant's `tool_calls` and `role: "tool"` results) go through the chat
template with the tools offered (tool_prompt.py); tool_choice required / named send the grammar
of a call (tool_schemas.forced_guide). With tools offered, each choice's output is read by the
tool-call parser (the template's format, or the grammar's when forced) as content and calls: the
non-streamed message gets `tool_calls`, a stream gets their deltas (tool_stream.py), and a choice
that made calls and ended on its own finishes with "tool_calls".
"""

from __future__ import annotations

from fastapi import Request, Response

from trtforge.frontend.endpoints import (
    Answer,
    chat_prompt_texts,
    check_model,
    check_prompt_size,
    collect,
    offload,
    start_answer,
    stream_answer,
)
from trtforge.frontend.generation import Tally, chat_logprobs, vllm_prompt_logprobs
from trtforge.frontend.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    FinishReason,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from trtforge.frontend.samples import Sample
from trtforge.frontend.schemas import ChatCompletionRequest
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.streaming import sse
from trtforge.frontend.tool_schemas import check_schemas
from trtforge.frontend.tool_stream import ToolCallStream, Update
from trtforge.frontend.triton_bridge import Piece


def _finish(tally: Tally, calls: ToolCallStream | None) -> FinishReason:
    """The engine's reason, or "tool_calls" for a choice that made calls and ended on its own."""
    reason = tally.finish_reason()
    return "tool_calls" if reason == "stop" and calls is not None and calls.calls else reason


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    """POST /v1/chat/completions."""
    served = check_model(request, body.model)
    check_prompt_size(request, chat_prompt_texts(body.messages, body.tools), body, "messages")
    if body.tools:
        await offload(request, check_schemas, body.tools)
    tools = body.offered_tools()
    prompt = await offload(request, served.chat_prompt, body.messages, tools)
    # Without a limit a reply may use the rest of the context (as OpenAI). A prompt that leaves
    # no room is sent with 1 so that the engine refuses it with its own message.
    max_tokens = body.token_limit() or max(1, served.max_seq_len - await offload(request, served.count_tokens, prompt))
    parser = served.tool_parser(forced=body.forces_tool_call())
    keep_special = bool(tools) and served.keeps_special_tokens(forced=body.forces_tool_call())
    answer = start_answer(request, body, prompt, max_tokens, "chatcmpl", keep_special_tokens=keep_special)
    streams = [ToolCallStream(parser) if tools else None for _ in range(body.num_choices())]
    if body.stream:
        return await _stream(request, body, served, answer, streams)
    if not await collect(request, answer):
        return Response(status_code=499)
    choices = [_choice(body, served, sample, streams[sample.index]) for sample in answer.samples.samples]
    prompt_logprobs = None
    if body.prompt_logprobs is not None:  # the rendered prompt's, as vLLM (the same for every choice)
        prompt_ids = await offload(request, served.encode, prompt)
        prompt_logprobs = vllm_prompt_logprobs(served, prompt_ids, answer.samples.samples[0].tally.prompt_logprobs,
                                               body.prompt_logprobs)
    return ChatCompletion(id=answer.id, created=answer.created, model=answer.model, choices=choices,
                          usage=answer.samples.usage(), prompt_logprobs=prompt_logprobs)


def _choice(body: ChatCompletionRequest, served: ServedModel, sample: Sample,
            calls: ToolCallStream | None) -> ChatChoice:
    tally = sample.tally
    message = ChatResponseMessage(content=tally.text)
    if calls is not None:
        calls.feed(tally.text)
        calls.finish()
        if calls.calls:
            message = ChatResponseMessage(content=calls.content or None, tool_calls=[
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in calls.calls])
    logprobs = chat_logprobs(served, tally.token_texts, tally.logprobs, tally.top_logprobs,
                             body.num_top_logprobs()) if body.wants_logprobs() else None
    return ChatChoice(index=sample.index, message=message, logprobs=logprobs, finish_reason=_finish(tally, calls),
                      stop_reason=tally.stop_reason(),
                      avg_decoded_tokens_per_iter=tally.avg_decoded_tokens_per_iter())


async def _stream(request: Request, body: ChatCompletionRequest, served: ServedModel, answer: Answer,
                  streams: list[ToolCallStream | None]) -> Response:
    want_logprobs, want_top = body.wants_logprobs(), body.num_top_logprobs()
    usage_excluded = None if body.include_usage() else {"usage"}

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=answer.id, created=answer.created, model=answer.model,
                                       choices=[choice]), usage_excluded)

    def update_chunks(index: int, update: Update) -> list[str]:
        return [chunk(ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[ToolCallDelta(
            index=d.index, id=d.id, type="function" if d.id else None,
            function=FunctionCallDelta(name=d.name, arguments=d.arguments))])))
            for d in update.calls]

    def piece_chunks(sample: Sample, piece: Piece, texts: list[str]) -> list[str]:
        calls = streams[sample.index]
        update = calls.feed(piece.text) if calls is not None else Update(content=piece.text)
        out = []
        if update.content or (want_logprobs and texts):
            logprobs = chat_logprobs(served, texts, piece.logprobs, piece.top_logprobs or [],
                                     want_top) if want_logprobs else None
            out.append(chunk(ChatChunkChoice(index=sample.index, delta=ChatDelta(content=update.content),
                                             logprobs=logprobs)))
        return out + update_chunks(sample.index, update)

    def tails(sample: Sample) -> list[str]:
        calls = streams[sample.index]
        out = []
        if calls is not None:
            update = calls.finish()
            if update.content:
                out.append(chunk(ChatChunkChoice(index=sample.index, delta=ChatDelta(content=update.content))))
            out += update_chunks(sample.index, update)
        return out + [chunk(ChatChunkChoice(index=sample.index, delta=ChatDelta(),
                                            finish_reason=_finish(sample.tally, calls),
                                            stop_reason=sample.tally.stop_reason(),
                                            avg_decoded_tokens_per_iter=sample.tally.avg_decoded_tokens_per_iter()))]

    heads = [chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
             for i in range(body.num_choices())]
    return await stream_answer(
        request, answer, body, piece_chunks, heads, tails,
        lambda: sse(ChatCompletionChunk(id=answer.id, created=answer.created, model=answer.model, choices=[],
                                        usage=answer.samples.usage())))
