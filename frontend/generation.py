"""From an API request to the ensemble's inputs, and from its responses to a tally of the answer.

Defaults are OpenAI's where the request leaves a field out (temperature 1, top_p 1; completions
`max_tokens` 16, chat up to the context length); the ensemble's own defaults (greedy) apply only
to what OpenAI does not define.

Usage and finish reasons are the engine's own: the ensemble's last response carries
`num_input_tokens`, `num_output_tokens`, `num_cached_tokens` (usage.prompt_tokens_details),
`finish_reason` (stop | length) and `stop_reason` / `stop_token_id` (vLLM's `stop_reason`), and
from an engine that speculates `avg_decoded_tokens_per_iter` (trtllm-serve's choice field).
Log-probabilities are asked for only when the client wants them (`return_log_probs`, and
`num_top_logprobs` for alternatives).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

import numpy as np

from trtforge.frontend.errors import server_error
from trtforge.frontend.responses import (
    ChatLogprob,
    ChatLogprobs,
    CompletionLogprobs,
    FinishReason,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from trtforge.frontend.schemas import SamplingFields
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import Piece, PromptEntry
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


_REQUEST_SEED = object()


def ensemble_inputs(req: SamplingFields, prompt: str, max_tokens: int,
                    cache_salt: str | None = None, seed: int | None | object = _REQUEST_SEED,
                    keep_special_tokens: bool = False) -> dict[str, np.ndarray]:
    """The ensemble's input arrays for one request: streamed; with per-token log-probabilities
    (and `num_top_logprobs` alternatives) when the client asked for them, and the prompt's
    (`prompt_logprobs`, echo with logprobs). `cache_salt`: the request's prefix-cache salt as the
    guard resolved it (guard.request_cache_salt); `seed`: this choice's seed (samples.choice_seed),
    the request's when not given; `keep_special_tokens`: skip_special_tokens=false whatever the
    request says (a tool-call parser reads a special-token marker)."""
    top_p = req.top_p
    if top_p == 0.0:
        top_p = TOP_P_MOST_LIKELY
    stops = [csv_field(word) for word in req.stop_list()]
    guide_type, guide = req.guide()  # structured output: response_format / structured_outputs
    top = req.num_top_logprobs()
    return request_arrays(
        prompt, max_tokens, stream=True, return_log_probs=req.wants_logprobs() or None,
        num_top_logprobs=top or None, exclude_input_in_output=True,
        temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=top_p, top_k=req.top_k, seed=req.seed if seed is _REQUEST_SEED else seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, stop_words=stops or None,
        min_tokens=max_tokens if req.ignore_eos else req.min_tokens, cache_salt=cache_salt,
        guided_decoding_guide_type=guide_type, guided_decoding_guide=guide,
        prompt_logprobs=req.engine_prompt_logprobs(),
        skip_special_tokens=False if keep_special_tokens or req.skip_special_tokens is False else None,
        speculative=req.speculative)


@dataclass
class Tally:
    """Everything the responses of one request said, summed up."""

    served: ServedModel
    prompt: str
    max_tokens: int
    text: str = ""
    token_texts: list[str] = field(default_factory=list)
    """The text each generated token added (when log-probabilities are asked for: a response's
    text goes to its first token; a token whose text the server held back, e.g. half a UTF-8
    character, adds "")."""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    last: Piece | None = None
    """The request's last response: the counts and why it finished."""
    prompt_logprobs: list[PromptEntry] | None = None
    """The prompt's log-probabilities (prompt_logprobs, echo with logprobs), from the response
    that carried them."""
    output_tokens: int = 0
    """A TensorRT-LLM ensemble's tokens so far: it counts per response, not on the last one."""
    input_tokens: int | None = None
    """A TensorRT-LLM ensemble's num_input_tokens, where its release reports it."""

    def add(self, piece: Piece) -> list[str]:
        """Record a response; returns the token texts it added."""
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        if self.served.trtllm is not None:  # per response: its num_output_tokens, or one logprob a token
            self.output_tokens += len(piece.logprobs) if piece.num_output_tokens is None else piece.num_output_tokens
            self.input_tokens = piece.num_input_tokens if piece.num_input_tokens is not None else self.input_tokens
        texts = [piece.text if i == 0 else "" for i in range(len(piece.logprobs))]
        self.text += piece.text
        self.token_texts += texts
        self.logprobs += piece.logprobs
        self.top_logprobs += piece.top_logprobs or []
        if piece.final or piece.finish_reason is not None:
            self.last = piece
        return texts

    def _ending(self) -> Piece:
        if self.served.trtllm is not None:
            return self._trtllm_ending()
        last = self.last
        if last is None or last.finish_reason is None or last.num_output_tokens is None \
                or last.num_input_tokens is None:
            # Every trtforge model sends them on its last response; one that does not is older
            # than this front end (or not trtforge's): nothing true could be reported.
            raise server_error("the ensemble's last response has no finish_reason / num_input_tokens / "
                               "num_output_tokens outputs: the repository's models are older than this "
                               "front end (re-emit it with `trtforge emit-repo`)")
        return last

    def _trtllm_ending(self) -> Piece:
        """What TensorRT-LLM's ensemble does not say, derived: the tokens summed over the responses,
        the prompt's tokens as its preprocessing counts them (the engine's tokenizer, no special
        tokens added: served.count_tokens) where the release does not report them, and the finish
        reason: "stop" with the stop string the text was cut at (trtllm_requests.stop_trimmed),
        else "length" when max_tokens tokens came, else "stop" (the end token: stop_reason null,
        no release says which token ended a request)."""
        if self.last is None:
            raise server_error("the TensorRT-LLM ensemble ended the request without a final response")
        prompt = self.input_tokens if self.input_tokens is not None else self.served.count_tokens(self.prompt)
        self.input_tokens = prompt
        stop = self.last.stop_reason  # the stop string trtllm_requests.stop_trimmed cut the text at
        reason = "length" if stop is None and self.output_tokens >= self.max_tokens else "stop"
        return Piece(text="", logprobs=[], final=True, num_input_tokens=prompt,
                     num_output_tokens=self.output_tokens, finish_reason=reason, stop_reason=stop)

    def usage(self) -> Usage:
        last = self._ending()
        prompt, completion = last.num_input_tokens, last.num_output_tokens
        details = None if last.num_cached_tokens is None else PromptTokensDetails(cached_tokens=last.num_cached_tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)

    def finish_reason(self) -> FinishReason:
        return self._ending().finish_reason  # type: ignore[return-value]  # stop | length: others are errors

    def stop_reason(self) -> str | int | None:
        return self._ending().stop_reason

    def avg_decoded_tokens_per_iter(self) -> float | None:
        """Tokens generated per engine step of this request (1 + the drafts accepted per step), from
        a speculating engine's last response; None when the engine does not speculate."""
        return self._ending().avg_decoded_tokens_per_iter


def completion_logprobs(served: ServedModel, texts: list[str], logprobs: list[float],
                        top: list[list[tuple[int, float]]], want_top: int,
                        offset: int = 0) -> CompletionLogprobs:
    """Legacy completions `logprobs` for tokens whose text starts at `offset`; with `want_top`
    alternatives, each token's {text: logprob} of its most likely tokens."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    alternatives = None
    if want_top:
        alternatives = []
        for row in top:
            entry: dict[str, float] = {}
            for token_id, lp in row:  # two ids with one text: the likelier stays (first, as sorted)
                entry.setdefault(served.token_text(token_id), lp)
            alternatives.append(entry)
    return CompletionLogprobs(tokens=texts, token_logprobs=logprobs, text_offset=offsets,
                              top_logprobs=alternatives)


def chat_logprobs(served: ServedModel, texts: list[str], logprobs: list[float],
                  top: list[list[tuple[int, float]]], want_top: int) -> ChatLogprobs:
    rows = (list(top) + [[]] * len(texts))[:len(texts)] if want_top else [[]] * len(texts)
    return ChatLogprobs(content=[
        ChatLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")), top_logprobs=[
            TopLogprob(token=(alt := served.token_text(token_id)), logprob=alt_lp, bytes=list(alt.encode("utf-8")))
            for token_id, alt_lp in row])
        for text, lp, row in zip(texts, logprobs, rows)])


def checked_entries(entries: list[PromptEntry] | None, prompt_ids: list[int]) -> list[PromptEntry]:
    """The prompt's entries, one per prompt token after the first (a 500 if the ensemble's answer
    does not fit the prompt as this front end tokenizes it)."""
    entries = entries or []
    if len(entries) != max(0, len(prompt_ids) - 1):
        raise server_error(f"the ensemble returned {len(entries)} prompt logprobs for a prompt of {len(prompt_ids)} "
                           "tokens: the repository's models are older than this front end, or tokenize otherwise")
    return entries


def vllm_prompt_logprobs(served: ServedModel, prompt_ids: list[int], entries: list[PromptEntry] | None,
                         k: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first token, then per prompt token {token id: entry}
    of the token itself and the `k` most likely tokens there (ranks 1..k)."""
    out: PromptLogprobs = [None]
    for token_id, entry in zip(prompt_ids[1:], checked_entries(entries, prompt_ids)):
        position = {str(token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                 decoded_token=served.token_text(token_id))}
        for rank, (alt, lp) in enumerate(entry.top[:k], start=1):
            position.setdefault(str(alt), PromptLogprob(logprob=lp, rank=rank, decoded_token=served.token_text(alt)))
        out.append(position)
    return out


def echo_logprobs(served: ServedModel, prompt_ids: list[int], texts: list[str], entries: list[PromptEntry] | None,
                  want_top: int) -> CompletionLogprobs:
    """Legacy completions `logprobs` of the echoed prompt (`texts`: each prompt token's text, as
    ServedModel.prompt_token_texts): the first token's logprob and alternatives null, as OpenAI."""
    entries = checked_entries(entries, prompt_ids)
    got = completion_logprobs(served, texts[1:], [e.logprob for e in entries], [e.top[:want_top] for e in entries],
                              want_top, offset=len(texts[0]) if texts else 0)
    return CompletionLogprobs(
        tokens=texts[:1] + got.tokens, token_logprobs=[None][:len(texts)] + got.token_logprobs,
        text_offset=[0][:len(texts)] + got.text_offset,
        top_logprobs=None if got.top_logprobs is None else [None][:len(texts)] + got.top_logprobs)


def joined_logprobs(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """Two runs of legacy `logprobs` (the echoed prompt's, then the generated tokens') as one."""
    tops = None if first.top_logprobs is None and then.top_logprobs is None else \
        (first.top_logprobs or []) + (then.top_logprobs or [])
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              text_offset=first.text_offset + then.text_offset, top_logprobs=tops)
