"""POST /v1/completions and POST /v1/chat/completions (and vLLM's POST /tokenize, /detokenize).

Both build a prompt, send it to the ensemble, and answer either at once (with `usage`) or as
server-sent events ending in `data: [DONE]`. A streamed request waits for the model's first
response before answering, so a request the model refuses (e.g. a prompt longer than the
engine's max_seq_len) still gets its 400 status rather than a 200 stream holding an error.

The prompt's size is checked before anything tokenizes it (400 beyond `max_prompt_chars`), and
the chat template and token counts run on a small thread pool (`app.state.tokenizer_pool`), not
on the event loop, so that a large or slow prompt does not hold up the other requests' streams.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request, Response

from trtforge.frontend.errors import INTERNAL_ERROR, REQUEST_ID, APIError, bad_request, log, model_not_found
from trtforge.frontend.generation import Tally, chat_logprobs, completion_logprobs, ensemble_inputs
from trtforge.frontend.guard import TENANT_SALT, Limits, request_cache_salt
from trtforge.frontend.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    DetokenizeResponse,
    TokenizeResponse,
)
from trtforge.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.streaming import DONE, ClientGone, SSEResponse, sse, sse_error, unless_disconnected
from trtforge.frontend.triton_bridge import Piece, TritonBridge

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API

T = TypeVar("T")


@dataclass
class Call:
    """One API request on its way through: ids, the tally, and the Triton stream."""

    id: str
    created: int
    model: str
    tally: Tally
    pieces: AsyncIterator[Piece]
    first: Piece | None = None

    async def collect(self) -> None:
        async for piece in self.pieces:
            self.tally.add(piece)

    async def start(self) -> None:
        self.first = await self.pieces.__anext__()

    async def rest(self) -> AsyncIterator[Piece]:
        if self.first is not None:
            yield self.first
        async for piece in self.pieces:
            yield piece


async def _call(request: Request, body: SamplingFields, prompt: str, max_tokens: int,
                prefix: str) -> Call:
    served: ServedModel = request.app.state.served
    bridge: TritonBridge = request.app.state.bridge
    salt = request_cache_salt(request.scope.get(TENANT_SALT), body.cache_salt)
    return Call(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=served.name,
                tally=Tally(served, prompt, max_tokens),
                pieces=bridge.generate(ensemble_inputs(body, prompt, max_tokens, salt)))


def _check_model(request: Request, model: str) -> ServedModel:
    served: ServedModel = request.app.state.served
    if model != served.name:
        raise model_not_found(model, served.name)
    return served


def _check_prompt_size(request: Request, texts: list[str], body: SamplingFields | TokenizeRequest,
                       param: str) -> None:
    """400 when the prompt text (with the stop strings) is over the cap: before tokenizing."""
    limits: Limits = request.app.state.limits
    stops = body.stop_list() if isinstance(body, SamplingFields) else []
    chars = sum(map(len, texts)) + sum(map(len, stops))
    if chars > limits.max_prompt_chars:
        raise bad_request(
            f"The {param} and stop strings hold {chars} characters; this server takes at most "
            f"{limits.max_prompt_chars} (`trtforge serve --max-prompt-chars`).", param=param,
            code="prompt_too_long")


async def _offload(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the tokenizer pool: the event loop keeps serving the other requests."""
    loop = asyncio.get_running_loop()
    job = functools.partial(contextvars.copy_context().run, fn, *args)  # the request id, too
    return await loop.run_in_executor(request.app.state.tokenizer_pool, job)


async def _stream(request: Request, call: Call, body: SamplingFields,
                  chunks: Callable[[Piece, list[str]], str | None],
                  head: str | None, tail: Callable[[Tally], str],
                  usage_chunk: Callable[[], str]) -> Response:
    """An SSE answer: head, one chunk per response with something in it, the finish chunk,
    the usage chunk when asked, [DONE]. Errors before the first response get their status."""
    try:
        await unless_disconnected(request, call.start())
    except ClientGone:
        return Response(status_code=499)

    async def events() -> AsyncIterator[str]:
        try:
            if head is not None:
                yield head
            async for piece in call.rest():
                chunk = chunks(piece, call.tally.add(piece))
                if chunk is not None:
                    yield chunk
            yield tail(call.tally)
            if body.include_usage():
                yield usage_chunk()
            yield DONE
        except APIError as exc:
            yield sse_error(exc)
        except Exception:  # noqa: BLE001 - a bug, after the status was sent: logged, a generic event
            log.exception("request %s: unexpected error in a stream", REQUEST_ID.get())
            yield sse_error(APIError(500, INTERNAL_ERROR, "server_error"))
        finally:
            await call.pieces.aclose()  # type: ignore[attr-defined]

    return SSEResponse(events())


async def _collect(request: Request, call: Call) -> bool:
    """Run the request to its end; False if the client left first."""
    try:
        await unless_disconnected(request, call.collect())
    except ClientGone:
        return False
    return True


async def create_completion(body: CompletionRequest, request: Request) -> Response | Completion:
    """POST /v1/completions."""
    served = _check_model(request, body.model)
    _check_prompt_size(request, [body.prompt_text()], body, "prompt")
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    call = await _call(request, body, body.prompt_text(), max_tokens, "cmpl")
    want_logprobs, want_top = body.wants_logprobs(), body.num_top_logprobs()
    echo = body.prompt_text() if body.echo else ""
    usage_excluded = None if body.include_usage() else {"usage"}

    def chunk(choices: list[CompletionChoice]) -> Completion:
        return Completion(id=call.id, created=call.created, model=call.model, choices=choices)

    def last(tally: Tally) -> CompletionChoice:
        return CompletionChoice(text="", finish_reason=tally.finish_reason(), stop_reason=tally.stop_reason())

    if body.stream:
        offset = [0]

        def piece_chunk(piece: Piece, texts: list[str]) -> str | None:
            if not piece.text and not (want_logprobs and texts):
                return None
            logprobs = completion_logprobs(served, texts, piece.logprobs, piece.top_logprobs or [], want_top,
                                           offset[0]) if want_logprobs else None
            offset[0] += len(piece.text)
            return sse(chunk([CompletionChoice(text=piece.text, logprobs=logprobs)]), usage_excluded)

        head = sse(chunk([CompletionChoice(text=echo)]), usage_excluded) if echo else None
        return await _stream(
            request, call, body, piece_chunk, head,
            lambda tally: sse(chunk([last(tally)]), usage_excluded),
            lambda: sse(chunk([]).model_copy(update={"usage": call.tally.usage()})))
    if not await _collect(request, call):
        return Response(status_code=499)
    tally = call.tally
    logprobs = completion_logprobs(served, tally.token_texts, tally.logprobs, tally.top_logprobs,
                                   want_top) if want_logprobs else None
    answer = chunk([CompletionChoice(text=echo + tally.text, logprobs=logprobs,
                                     finish_reason=tally.finish_reason(), stop_reason=tally.stop_reason())])
    return answer.model_copy(update={"usage": tally.usage()})


async def create_chat_completion(body: ChatCompletionRequest,
                                 request: Request) -> Response | ChatCompletion:
    """POST /v1/chat/completions."""
    served = _check_model(request, body.model)
    _check_prompt_size(request, [part for m in body.messages for part in (m.text(), m.name or "")],
                       body, "messages")
    prompt = await _offload(request, served.chat_prompt, body.messages)
    # Without a limit a reply may use the rest of the context (as OpenAI). A prompt that leaves
    # no room is sent with 1 so that the engine refuses it with its own message.
    max_tokens = body.token_limit() or max(
        1, served.max_seq_len - await _offload(request, served.count_tokens, prompt))
    call = await _call(request, body, prompt, max_tokens, "chatcmpl")
    want_logprobs, want_top = body.wants_logprobs(), body.num_top_logprobs()
    usage_excluded = None if body.include_usage() else {"usage"}

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=call.id, created=call.created, model=call.model,
                                   choices=choices)

    if body.stream:
        def piece_chunk(piece: Piece, texts: list[str]) -> str | None:
            if not piece.text and not (want_logprobs and texts):
                return None
            logprobs = chat_logprobs(served, texts, piece.logprobs, piece.top_logprobs or [],
                                     want_top) if want_logprobs else None
            return sse(chunk([ChatChunkChoice(delta=ChatDelta(content=piece.text),
                                              logprobs=logprobs)]), usage_excluded)

        head = sse(chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]),
                   usage_excluded)
        return await _stream(
            request, call, body, piece_chunk, head,
            lambda tally: sse(chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=tally.finish_reason(),
                                                     stop_reason=tally.stop_reason())]), usage_excluded),
            lambda: sse(chunk([]).model_copy(update={"usage": call.tally.usage()})))
    if not await _collect(request, call):
        return Response(status_code=499)
    tally = call.tally
    choice = ChatChoice(message=ChatResponseMessage(content=tally.text),
                        logprobs=chat_logprobs(served, tally.token_texts, tally.logprobs, tally.top_logprobs,
                                               want_top) if want_logprobs else None,
                        finish_reason=tally.finish_reason(), stop_reason=tally.stop_reason())
    return ChatCompletion(id=call.id, created=call.created, model=call.model, choices=[choice],
                          usage=tally.usage())


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """POST /tokenize (vLLM's): the token ids of a prompt, or of chat messages through the template."""
    served = _check_model(request, body.model)
    if body.messages is not None:
        _check_prompt_size(request, [part for m in body.messages for part in (m.text(), m.name or "")],
                           body, "messages")
        text = await _offload(request, served.chat_prompt, body.messages)
    else:
        _check_prompt_size(request, [body.prompt or ""], body, "prompt")
        text = body.prompt or ""

    def encode() -> list[int]:
        if body.add_special_tokens:
            return list(served.tokenizer.encode(text, add_special_tokens=True))
        return served.encode(text)

    tokens = await _offload(request, encode)
    strs = [served.token_text(t) for t in tokens] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=served.max_seq_len, tokens=tokens, token_strs=strs)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """POST /detokenize (vLLM's): the text of token ids."""
    served = _check_model(request, body.model)
    vocab = served.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=await _offload(request, served.decode, body.tokens))
