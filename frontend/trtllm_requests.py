"""An API request as the inputs of a TensorRT-LLM ensemble (trtllm_interface.py says which).

Every field the request sets becomes the release's input for it, typed as its record types it;
one the release has no input for is a 400 naming the field and the release. How the fields map:

* seed → `seed` (1.x) / `random_seed` (0.19), UINT64 either way; min_tokens → `min_tokens` (1.x) /
  `min_length` (0.19), INT32.
* ignore_eos → `end_id` = -1: what TensorRT-LLM's own LLM API sends for ignore_eos (executor
  base_worker.py, `end_id=-1 if ignore_eos`). No token id is -1, so the end token never ends the
  request, and stop strings still do, as with trtforge's engine. (min_length = max_tokens would
  work too, but a penalty per step where end_id -1 costs nothing.)
* temperature 0 → `top_k` = 1 and no temperature: greedy as TensorRT-LLM defines it, whatever a
  release makes of a temperature of 0.
* top_k -1 → `top_k` 0 (TensorRT-LLM's "no top-k"); top_p 0 → 1e-6 (generation.TOP_P_MOST_LIKELY).
* stop → `stop_words`, one string per element: TensorRT-LLM's preprocessing encodes each element
  as one word (trtforge's own ensemble reads CSV fields).
* structured output and forced tool calls → `guided_decoding_guide_type` / `guided_decoding_guide`,
  only when the repository's tensorrt_llm model has a guided_decoding_backend.

Always sent: `stream` true, `exclude_input_in_output` true (the front end echoes itself), and
what the usage needs: `return_num_input_tokens` / `return_num_output_tokens` where the release has
them, else `return_log_probs` (each response's `output_log_probs` has one entry per token it added).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, AsyncIterator

import numpy as np

from trtforge.frontend.errors import bad_request
from trtforge.frontend.generation import OPENAI_TEMPERATURE, TOP_P_MOST_LIKELY
from trtforge.frontend.schemas import SamplingFields
from trtforge.frontend.triton_bridge import Piece
from trtforge.frontend.trtllm_interface import GUIDED_FIELDS, TrtllmInterface

NO_END_ID = -1
"""end_id for ignore_eos (see the table above)."""


def _top_k(top_k: int | None) -> int | None:
    return 0 if top_k == -1 else top_k


def _fields(iface: TrtllmInterface, req: SamplingFields, prompt: str, max_tokens: int,
            cache_salt: str | None, seed: int | None) -> list[tuple[str, str, Any]]:
    """(request field, trtforge input name, value) of every input the request needs; None: not sent."""
    greedy = req.temperature == 0.0
    temperature = None if greedy else (OPENAI_TEMPERATURE if req.temperature is None else req.temperature)
    top_p = TOP_P_MOST_LIKELY if req.top_p == 0.0 else req.top_p
    guide_type, guide = req.guide()
    top = req.num_top_logprobs()
    counts_outputs = iface.has_output("num_output_tokens")
    top_field = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
    return [
        ("prompt", "text_input", prompt), ("max_tokens", "max_tokens", max_tokens),
        ("stream", "stream", True), ("echo", "exclude_input_in_output", True),
        ("temperature", "temperature", temperature), ("top_k", "top_k", 1 if greedy else _top_k(req.top_k)),
        ("top_p", "top_p", top_p), ("seed", "seed", seed),
        ("presence_penalty", "presence_penalty", req.presence_penalty),
        ("frequency_penalty", "frequency_penalty", req.frequency_penalty),
        ("stop", "stop_words", req.stop_list() or None),
        ("min_tokens", "min_tokens", req.min_tokens or None),
        ("ignore_eos", "end_id", NO_END_ID if req.ignore_eos else None),
        ("logprobs", "return_log_probs", True if req.wants_logprobs() or not counts_outputs else None),
        ("usage", "return_num_input_tokens", True if iface.has_output("num_input_tokens") else None),
        ("usage", "return_num_output_tokens", True if counts_outputs else None),
        (GUIDED_FIELDS, "guided_decoding_guide_type", guide_type),
        (GUIDED_FIELDS, "guided_decoding_guide", guide),
        (top_field, "num_top_logprobs", top or None),
        ("prompt_logprobs" if req.prompt_logprobs is not None else "echo with logprobs", "prompt_logprobs",
         req.engine_prompt_logprobs()),
        ("cache_salt", "cache_salt", cache_salt),
        ("speculative", "speculative", getattr(req, "speculative", None)),
    ]


def check_special_tokens(iface: TrtllmInterface, req: SamplingFields) -> None:
    """skip_special_tokens is the postprocessing model's parameter in every release: a request may
    only ask for what the repository does."""
    if "skip_special_tokens" in req.model_fields_set and req.skip_special_tokens is not None \
            and bool(req.skip_special_tokens) != iface.skips_special_tokens:
        raise bad_request(
            f"skip_special_tokens={str(req.skip_special_tokens).lower()}: {iface.label} has no input for it; the "
            f"repository's postprocessing model decides for every request (its parameter skip_special_tokens="
            f"{str(iface.skips_special_tokens).lower()}); leave the field out or send that value.",
            param="skip_special_tokens")


def trtllm_inputs(iface: TrtllmInterface, req: SamplingFields, prompt: str, max_tokens: int,
                  cache_salt: str | None = None, seed: int | None = None) -> dict[str, np.ndarray]:
    """The ensemble's input arrays for one request (`seed`: this choice's, samples.choice_seed);
    APIError 400 for a field the release or the repository cannot honour (module doc)."""
    check_special_tokens(iface, req)
    fields = [f for f in _fields(iface, req, prompt, max_tokens, cache_salt, seed) if f[2] is not None]
    for field, ours, _ in fields:
        if iface.name_of(ours) is None:
            raise iface.absent(field, ours)
        if ours.startswith("guided_decoding") and not iface.guided_decoding:
            raise bad_request(
                f"{GUIDED_FIELDS}: the repository's tensorrt_llm model has no guided_decoding_backend "
                f"(emit-repo leaves it unset), so {iface.label} cannot constrain the output; leave them out.",
                param="response_format")
    return iface.arrays({ours: value for _, ours, value in fields})


def _held(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that starts a stop string (held back until decided)."""
    for n in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-n:]) for stop in stops):
            return n
    return 0


async def stop_trimmed(pieces: AsyncIterator[Piece], stops: list[str]) -> AsyncIterator[Piece]:
    """A TensorRT-LLM request's responses with the text cut before the first stop string.

    TensorRT-LLM ends a request on a stop word and keeps the word in its output (its own LLM API
    strips it, include_stop_str_in_output); OpenAI's text ends before it. Text that may be the start
    of a stop string is held back until the next response decides; the string that matched is the
    last response's stop_reason. Token counts and log-probabilities are left as they came."""
    held, stopped = "", None
    try:
        async for piece in pieces:
            text = held + piece.text if stopped is None else ""
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                at, stopped = min(found)
                text, held = text[:at], ""
            elif stopped is None and not piece.final:
                keep = _held(text, stops)
                text, held = text[:len(text) - keep], text[len(text) - keep:]
            yield replace(piece, text=text, stop_reason=stopped if piece.final else None)
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]  # cancels the Triton request if unfinished
