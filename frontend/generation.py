"""From an API request to the ensemble's inputs, and from its responses to a tally of the answer.

Defaults are OpenAI's where the request leaves a field out (temperature 1, top_p 1; completions
`max_tokens` 16, chat up to the context length); the ensemble's own defaults (greedy) apply only
to what OpenAI does not define.

The ensemble does not say why a request finished. Finish reasons are derived from the counts it
returns: `length` when the request produced its `max_tokens` tokens (the engine refuses a
request whose prompt + max_tokens exceeds max_seq_len, so that is the only limit), otherwise
`stop` (an EOS token or a stop string). A request whose EOS or stop string falls exactly on its
last allowed token is therefore reported as `length` (docs/serving.md says so too).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

import numpy as np

from trtforge.frontend.responses import ChatLogprob, ChatLogprobs, CompletionLogprobs, FinishReason, Usage
from trtforge.frontend.schemas import SamplingFields
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece
from trtforge.model_repo.client import request_arrays

OPENAI_TEMPERATURE = 1.0
"""OpenAI's default temperature (the ensemble's own default is 0, greedy)."""
TOP_P_MOST_LIKELY = 1e-6
"""What OpenAI's top_p=0 (only the most likely token) is sent as: the ensemble reads 0 as
"no filter", as TensorRT-LLM does; a tiny nucleus keeps exactly the most likely token."""


def csv_field(word: str) -> str:
    """One stop string as the single CSV field the ensemble's stop_words parser reads back."""
    buffer = io.StringIO()
    csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="").writerow([word])
    return buffer.getvalue()


def ensemble_inputs(req: SamplingFields, prompt: str, max_tokens: int,
                    cache_salt: str | None = None) -> dict[str, np.ndarray]:
    """The ensemble's input arrays for one request: streamed, with per-token log-probabilities
    (they count the completion tokens and carry `logprobs` when asked). `cache_salt`: the
    request's prefix-cache salt as the guard resolved it (guard.request_cache_salt)."""
    top_p = req.top_p
    if top_p == 0.0:
        top_p = TOP_P_MOST_LIKELY
    stops = [csv_field(word) for word in req.stop_list()]
    guide_type, guide = req.guide()  # structured output: response_format / structured_outputs
    return request_arrays(
        prompt, max_tokens, stream=True, return_log_probs=True, exclude_input_in_output=True,
        temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=top_p, top_k=req.top_k, seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, stop_words=stops or None,
        min_tokens=max_tokens if req.ignore_eos else req.min_tokens, cache_salt=cache_salt,
        guided_decoding_guide_type=guide_type, guided_decoding_guide=guide)


@dataclass
class Tally:
    """Everything the responses of one request said, summed up."""

    served: ServedModel
    prompt: str
    max_tokens: int
    text: str = ""
    token_texts: list[str] = field(default_factory=list)
    """The text each generated token added: a response's text goes to its first token (a token
    whose text the server held back, e.g. half a UTF-8 character, adds "")."""
    logprobs: list[float] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None

    def add(self, piece: Piece) -> list[str]:
        """Record a response; returns the token texts it added."""
        texts = [piece.text if i == 0 else "" for i in range(len(piece.logprobs))]
        self.text += piece.text
        self.token_texts += texts
        self.logprobs += piece.logprobs
        if piece.num_input_tokens is not None:
            self.num_input_tokens = piece.num_input_tokens
        if piece.num_output_tokens is not None:
            self.num_output_tokens = piece.num_output_tokens
        return texts

    def completion_tokens(self) -> int:
        # The model's own count; each generated token carried one log-probability, so the
        # fallback is exact too.
        return len(self.logprobs) if self.num_output_tokens is None else self.num_output_tokens

    def usage(self) -> Usage:
        # The model's own prompt count; the fallback encodes the prompt as the engine does (the
        # endpoints run it off the event loop first: endpoints._settle).
        prompt = self.num_input_tokens
        if prompt is None:
            prompt = self.served.count_tokens(self.prompt)
        completion = self.completion_tokens()
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)

    def finish_reason(self) -> FinishReason:
        return "length" if self.completion_tokens() >= self.max_tokens else "stop"


def completion_logprobs(texts: list[str], logprobs: list[float],
                        offset: int = 0) -> CompletionLogprobs:
    """Legacy completions `logprobs` for tokens whose text starts at `offset`."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=texts, token_logprobs=logprobs, text_offset=offsets)


def chat_logprobs(texts: list[str], logprobs: list[float]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))
        for text, lp in zip(texts, logprobs)])
