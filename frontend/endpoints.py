"""POST /v1/completions (and vLLM's POST /tokenize, /detokenize), and what POST
/v1/chat/completions (chat.py) shares with it.

Both build a prompt, send it to the ensemble as `n` requests (samples.py), and answer either at
once (with `usage`) or as server-sent events ending in `data: [DONE]`, each chunk naming its
choice's `index`. A streamed request waits for the model's first response of every choice before
answering, so a request the model refuses (e.g. a prompt longer than the engine's max_seq_len)
still gets its 400 status rather than a 200 stream holding an error.

The prompt's size is checked before anything tokenizes it (400 beyond `max_prompt_chars`), and
the chat template and token counts run on a small thread pool (`app.state.tokenizer_pool`), not
on the event loop, so that a large or slow prompt does not hold up the other requests' streams.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

import numpy as np
from fastapi import Request, Response

from trtforge.frontend.errors import INTERNAL_ERROR, REQUEST_ID, APIError, bad_request, log, model_not_found
from trtforge.frontend.generation import (
    Tally,
    completion_logprobs,
    echo_logprobs,
    ensemble_inputs,
    joined_logprobs,
    vllm_prompt_logprobs,
)
from trtforge.frontend.guard import TENANT_SALT, Limits, request_cache_salt
from trtforge.frontend.responses import Completion, CompletionChoice, DetokenizeResponse, TokenizeResponse
from trtforge.frontend.samples import Sample, Samples, choice_seed
from trtforge.frontend.schemas import ChatMessage, CompletionRequest, SamplingFields
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.streaming import DONE, ClientGone, SSEResponse, sse, sse_error, unless_disconnected
from trtforge.frontend.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from trtforge.frontend.tool_schemas import Tool, check_schemas
from trtforge.frontend.triton_bridge import Piece, TritonBridge
from trtforge.frontend.trtllm_requests import stop_trimmed, trtllm_inputs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API

T = TypeVar("T")


@dataclass
class Answer:
    """One API request on its way through: its id and its choices' engine requests."""

    id: str
    created: int
    model: str
    samples: Samples


def start_answer(request: Request, body: SamplingFields, prompt: str, max_tokens: int, prefix: str,
                 keep_special_tokens: bool = False) -> Answer:
    """The request's `n` engine requests, ready to start (samples.Samples); `keep_special_tokens`:
    skip_special_tokens=false (a tool-call parser reads a special-token marker)."""
    served: ServedModel = request.app.state.served
    bridge: TritonBridge = request.app.state.bridge
    salt = request_cache_salt(request.scope.get(TENANT_SALT), body.cache_salt)
    iface = served.trtllm

    def inputs(i: int) -> dict[str, np.ndarray]:
        if iface is not None:  # TensorRT-LLM's ensemble; its postprocessing decides special tokens
            return trtllm_inputs(iface, body, prompt, max_tokens, salt, seed=choice_seed(body.seed, i))
        return ensemble_inputs(body, prompt, max_tokens, salt, seed=choice_seed(body.seed, i),
                               keep_special_tokens=keep_special_tokens)

    stops = body.stop_list()

    def generate(arrays: dict[str, np.ndarray]) -> AsyncIterator[Piece]:
        if iface is not None and stops:  # TensorRT-LLM keeps the stop string in its output
            return stop_trimmed(bridge.generate(arrays), stops)
        return bridge.generate(arrays)

    samples = Samples(body.num_choices(), lambda: Tally(served, prompt, max_tokens), generate, inputs)
    return Answer(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=served.name, samples=samples)


def check_model(request: Request, model: str) -> ServedModel:
    served: ServedModel = request.app.state.served
    if model != served.name:
        raise model_not_found(model, served.name)
    return served


def check_prompt_size(request: Request, texts: list[str], body: SamplingFields | TokenizeRequest,
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


def chat_prompt_texts(messages: list[ChatMessage], tools: list[Tool] | None) -> list[str]:
    """What the size cap counts of a conversation: the messages' texts and names, their calls, the tools."""
    texts = [part for m in messages for part in (m.text(), m.name or "")]
    texts += [c.function.name + c.function.arguments for m in messages for c in m.tool_calls or []]
    return texts + [json.dumps(t.model_dump(exclude_none=True)) for t in tools or []]


async def offload(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the tokenizer pool: the event loop keeps serving the other requests."""
    loop = asyncio.get_running_loop()
    job = functools.partial(contextvars.copy_context().run, fn, *args)  # the request id, too
    return await loop.run_in_executor(request.app.state.tokenizer_pool, job)


async def stream_answer(request: Request, answer: Answer, body: SamplingFields,
                        chunks: Callable[[Sample, Piece, list[str]], Sequence[str]],
                        heads: Sequence[str], tails: Callable[[Sample], Sequence[str]],
                        usage_chunk: Callable[[], str]) -> Response:
    """An SSE answer: the heads, the chunks of each response (its choice's tally updated first),
    each choice's tails after its last response, the usage chunk when asked, [DONE]. Errors
    before the first responses get their status."""
    samples = answer.samples
    try:
        await unless_disconnected(request, samples.start())
    except ClientGone:
        await samples.aclose()
        return Response(status_code=499)
    except BaseException:
        await samples.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for head in heads:
                yield head
            async for sample, piece in samples.merged():
                for chunk in chunks(sample, piece, sample.tally.add(piece)):
                    yield chunk
                if piece.final:
                    for chunk in tails(sample):
                        yield chunk
            if body.include_usage():
                yield usage_chunk()
            yield DONE
        except APIError as exc:
            yield sse_error(exc)
        except Exception:  # noqa: BLE001 - a bug, after the status was sent: logged, a generic event
            log.exception("request %s: unexpected error in a stream", REQUEST_ID.get())
            yield sse_error(APIError(500, INTERNAL_ERROR, "server_error"))
        finally:
            await samples.aclose()

    return SSEResponse(events())


async def collect(request: Request, answer: Answer) -> bool:
    """Run every choice to its end; False if the client left first."""
    async def run() -> None:
        await answer.samples.start()
        await answer.samples.collect()

    try:
        await unless_disconnected(request, run())
    except ClientGone:
        return False
    finally:
        await answer.samples.aclose()
    return True


async def create_completion(body: CompletionRequest, request: Request) -> Response | Completion:
    """POST /v1/completions."""
    served = check_model(request, body.model)
    check_prompt_size(request, [body.prompt_text()], body, "prompt")
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    answer = start_answer(request, body, body.prompt_text(), max_tokens, "cmpl")
    want_logprobs, want_top = body.wants_logprobs(), body.num_top_logprobs()
    echo = body.prompt_text() if body.echo else ""
    usage_excluded = None if body.include_usage() else {"usage"}
    # Prompt logprobs are keyed by the prompt's token ids, tokenized as the engine does.
    prompt_ids = await offload(request, served.encode, body.prompt_text()) \
        if body.engine_prompt_logprobs() is not None else []
    echo_texts = await offload(request, served.prompt_token_texts, prompt_ids) if body.echoes_logprobs() else []

    def chunk(choices: list[CompletionChoice]) -> Completion:
        return Completion(id=answer.id, created=answer.created, model=answer.model, choices=choices)

    def echoed(tally: Tally) -> Any:
        return echo_logprobs(served, prompt_ids, echo_texts, tally.prompt_logprobs, want_top)

    if body.stream:
        offsets = [len(echo) if body.echoes_logprobs() else 0] * body.num_choices()
        echo_sent: set[int] = set()

        def piece_chunks(sample: Sample, piece: Piece, texts: list[str]) -> list[str]:
            out = []
            if body.echoes_logprobs() and sample.index not in echo_sent:  # the prompt, with its logprobs
                echo_sent.add(sample.index)
                out.append(sse(chunk([CompletionChoice(index=sample.index, text=echo,
                                                       logprobs=echoed(sample.tally))]), usage_excluded))
            if not piece.text and not (want_logprobs and texts):
                return out
            logprobs = completion_logprobs(served, texts, piece.logprobs, piece.top_logprobs or [], want_top,
                                           offsets[sample.index]) if want_logprobs else None
            offsets[sample.index] += len(piece.text)
            return out + [sse(chunk([CompletionChoice(index=sample.index, text=piece.text, logprobs=logprobs)]),
                              usage_excluded)]

        def tails(sample: Sample) -> list[str]:
            return [sse(chunk([CompletionChoice(index=sample.index, text="", finish_reason=sample.tally.finish_reason(),
                                                stop_reason=sample.tally.stop_reason(),
                                                avg_decoded_tokens_per_iter=sample.tally.avg_decoded_tokens_per_iter())]),
                        usage_excluded)]

        heads = [sse(chunk([CompletionChoice(index=i, text=echo)]), usage_excluded)
                 for i in range(body.num_choices())] if echo and not body.echoes_logprobs() else []
        return await stream_answer(request, answer, body, piece_chunks, heads, tails,
                                   lambda: sse(chunk([]).model_copy(update={"usage": answer.samples.usage()})))
    if not await collect(request, answer):
        return Response(status_code=499)
    choices = []
    for sample in answer.samples.samples:
        tally = sample.tally
        logprobs = completion_logprobs(served, tally.token_texts, tally.logprobs, tally.top_logprobs,
                                       want_top, offset=len(echo)) if want_logprobs else None
        if body.echoes_logprobs():
            logprobs = joined_logprobs(echoed(tally), logprobs)
        prompt_logprobs = None if body.prompt_logprobs is None else vllm_prompt_logprobs(
            served, prompt_ids, tally.prompt_logprobs, body.prompt_logprobs)
        choices.append(CompletionChoice(index=sample.index, text=echo + tally.text, logprobs=logprobs,
                                        finish_reason=tally.finish_reason(), stop_reason=tally.stop_reason(),
                                        avg_decoded_tokens_per_iter=tally.avg_decoded_tokens_per_iter(),
                                        prompt_logprobs=prompt_logprobs))
    return chunk(choices).model_copy(update={"usage": answer.samples.usage()})


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """POST /tokenize (vLLM's): the token ids of a prompt, or of chat messages through the template."""
    served = check_model(request, body.model)
    if body.messages is not None:
        check_prompt_size(request, chat_prompt_texts(body.messages, body.tools), body, "messages")
        if body.tools:
            await offload(request, check_schemas, body.tools)
        # The same prompt as a chat completion with these messages and tools (tool_choice auto).
        text = await offload(request, served.chat_prompt, body.messages, body.tools or None)
    else:
        check_prompt_size(request, [body.prompt or ""], body, "prompt")
        text = body.prompt or ""

    def encode() -> list[int]:
        if body.add_special_tokens:
            return list(served.tokenizer.encode(text, add_special_tokens=True))
        return served.encode(text)

    tokens = await offload(request, encode)
    strs = [served.token_text(t) for t in tokens] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=served.max_seq_len, tokens=tokens, token_strs=strs)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """POST /detokenize (vLLM's): the text of token ids."""
    served = check_model(request, body.model)
    vocab = served.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=await offload(request, served.decode, body.tokens))
