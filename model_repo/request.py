"""Turn the tensors of one Triton request into a prompt and SamplingParams.

Plain numpy in, dataclass out, so it is testable without Triton. The tensor names and meanings
are those of TensorRT-LLM's `ensemble` (TensorRT-LLM's inflight_batcher_llm). Differences, all documented in
docs/serving.md:

* `stop_words` / `bad_words`: each string element is read as one CSV line, as TensorRT-LLM's
  preprocessing does (`"foo,bar"` is two words, `'"a,b"'` one word containing a comma).
* `end_id` adds a stop token; the model's EOS still ends the request too. It must be a token id
  of the model's vocabulary (the engine refuses one beyond it, naming it).
* `top_p == 0` means "no nucleus filter", as in TensorRT-LLM (our SamplingParams spells it 1.0).
* `timeout_s` (a trtforge input): seconds until the engine aborts the request; 0 means no
  deadline, like Triton's own request timeout.
* `cache_salt` (a trtforge input, vLLM's field): the request's prefix-cache namespace; requests
  with different salts never share cached prompt blocks. A non-empty UTF-8 string of at most 512
  characters (SamplingParams.cache_salt).
* `guided_decoding_guide_type` / `guided_decoding_guide` (TensorRT-LLM's structured output):
  json, json_schema, regex, ebnf_grammar or structural_tag, and the schema / regex / grammar text
  (none for json; at most 64 KiB). An empty type means none, as an unset optional input. The
  engine compiles the guide at admission: one that does not compile is refused ("bad request").
* `num_top_logprobs` (a trtforge input, vLLM's `logprobs`): 0..20 most likely tokens per
  generated token, returned as `top_logprobs_ids` / `top_logprobs`; > 0 implies
  `return_log_probs`.
* `prompt_logprobs` (a trtforge input; vLLM's and TensorRT-LLM's LLM-API SamplingParams field):
  K in 0..20, the log-probability of every prompt token after the first and the K most likely
  tokens at each position (outputs `prompt_log_probs`, `prompt_logprob_ranks`,
  `prompt_top_logprobs_ids`, `prompt_top_logprobs`). Left out: none.
* `skip_special_tokens` (a trtforge input, vLLM's field; default true): false keeps special tokens
  (`[TOOL_CALLS]`, `<|python_tag|>`, EOS) in `text_output`.
* `pad_id` and `length_penalty` are accepted and have no effect (packed batches have no padding;
  there is no beam search); `pad_id` must still be a token id >= 0. `beam_width` /
  `num_return_sequences` other than 1 and `return_context_logits` / `return_generation_logits`
  are refused with an error.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from trtforge.config.sampling import MAX_LOGPROBS, SamplingParams

# Tensor name → SamplingParams field, for the numeric inputs that map one to one.
_DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "min_tokens": ("min_tokens", int),
}


@dataclass
class GenerationRequest:
    """What one Triton request asks the engine for."""

    prompt: str
    """The text to continue (`text_input`)."""
    params: SamplingParams
    """Sampling and stopping, validated."""
    stream: bool = False
    """Send a response per new piece of text (`stream`), else one response at the end."""
    exclude_input: bool = False
    """Leave the prompt out of a non-streamed `text_output`."""
    return_log_probs: bool = False
    """Also return `cum_log_probs` and `output_log_probs`."""
    num_top_logprobs: int = 0
    """Also return this many most likely tokens per generated token (`top_logprobs_ids`,
    `top_logprobs`)."""

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives asked for per prompt position (`prompt_logprobs`); None: none asked."""
        return self.params.prompt_logprobs


def _scalar(inputs: Mapping[str, np.ndarray], name: str) -> Any | None:
    """The single value of an optional [1]/[1,1] tensor, or None when the request left it out."""
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise ValueError(
            f"input {name!r} has shape {list(arr.shape)}; send one value per request "
            "(shape [1], or [1, 1] with the batch dimension)."
        )
    value = arr.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"input {name!r} is not valid UTF-8 ({exc}).") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"input {name!r} must be a string, got {type(value).__name__}.")


def parse_words(arr: np.ndarray | None, name: str) -> list[str]:
    """stop_words / bad_words: every non-empty element is a CSV line of words."""
    if arr is None:
        return []
    words: list[str] = []
    for item in np.asarray(arr, dtype=object).reshape(-1):
        line = _text(item, name)
        if line.strip():
            words.extend(w for w in next(csv.reader([line])) if w)
    return words


def _token_id(inputs: Mapping[str, np.ndarray], name: str) -> int | None:
    """end_id / pad_id: an integer token id >= 0 (the engine checks it against its vocabulary)."""
    value = _scalar(inputs, name)
    if value is None:
        return None
    if (isinstance(value, float) and not value.is_integer()) or isinstance(value, (bytes, str)):
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer token id.")
    if int(value) < 0:
        raise ValueError(f"{name}={value} is invalid: it must be a token id >= 0 of the model's "
                         "vocabulary.")
    return int(value)


def _guide(inputs: Mapping[str, np.ndarray]) -> dict[str, str]:
    """guided_decoding_guide_type / guided_decoding_guide as SamplingParams fields (validated
    there: a known type, a guide where one is needed, its size)."""
    out: dict[str, str] = {}
    kind = _scalar(inputs, "guided_decoding_guide_type")
    if kind is not None and _text(kind, "guided_decoding_guide_type").strip():
        out["guided_decoding_guide_type"] = _text(kind, "guided_decoding_guide_type").strip().lower()
    guide = _scalar(inputs, "guided_decoding_guide")
    if guide is not None and (_text(guide, "guided_decoding_guide") or out):
        out["guided_decoding_guide"] = _text(guide, "guided_decoding_guide")
    return out


def _refuse_unsupported(inputs: Mapping[str, np.ndarray]) -> None:
    for name in ("beam_width", "num_return_sequences"):
        value = _scalar(inputs, name)
        if value is not None and int(value) != 1:
            raise ValueError(f"{name}={value} is not supported: trtforge samples one sequence per "
                             f"request; send {name}=1 or leave it out.")
    for name in ("return_context_logits", "return_generation_logits"):
        if _scalar(inputs, name):
            raise ValueError(f"{name}=true is not supported by trtforge; leave it out "
                             "(return_log_probs gives the log-probabilities of the output).")


def _num_top_logprobs(inputs: Mapping[str, np.ndarray]) -> int:
    value = _scalar(inputs, "num_top_logprobs")
    if value is None:
        return 0
    if isinstance(value, (bytes, str)) or (isinstance(value, float) and not value.is_integer()) \
            or not 0 <= int(value) <= MAX_LOGPROBS:
        raise ValueError(f"num_top_logprobs={value!r} is invalid: send an integer 0..{MAX_LOGPROBS} "
                         "(the most likely tokens returned per generated token).")
    return int(value)


def _prompt_logprobs(inputs: Mapping[str, np.ndarray]) -> int | None:
    value = _scalar(inputs, "prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, (bytes, str, bool)) or (isinstance(value, float) and not value.is_integer()) \
            or not 0 <= int(value) <= MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs={value!r} is invalid: send an integer 0..{MAX_LOGPROBS} (the most "
                         "likely tokens returned per prompt position), or leave it out.")
    return int(value)


def parse_request(inputs: Mapping[str, np.ndarray], exclude_input_default: bool = False
                  ) -> GenerationRequest:
    """Build a GenerationRequest; ValueError says which input is wrong and what to send."""
    text_input = inputs.get("text_input")
    if text_input is None or np.asarray(text_input).size != 1:
        shape = None if text_input is None else list(np.asarray(text_input).shape)
        raise ValueError(f"text_input must hold exactly one prompt per request (got shape {shape}).")
    prompt = _text(_scalar(inputs, "text_input"), "text_input")
    max_tokens = _scalar(inputs, "max_tokens")
    if max_tokens is None:
        raise ValueError("max_tokens is required: the most tokens to generate (an integer >= 1).")
    _refuse_unsupported(inputs)
    kwargs: dict[str, Any] = {"max_tokens": int(max_tokens)}
    for name, (field, cast) in _DIRECT.items():
        value = _scalar(inputs, name)
        if value is not None:
            kwargs[field] = cast(value)
    top_p = _scalar(inputs, "top_p")
    if top_p is not None:
        kwargs["top_p"] = 1.0 if float(top_p) == 0.0 else float(top_p)
    timeout_s = _scalar(inputs, "timeout_s")
    if timeout_s is not None and float(timeout_s) != 0.0:
        kwargs["timeout_s"] = float(timeout_s)
    end_id = _token_id(inputs, "end_id")
    if end_id is not None:
        kwargs["stop_token_ids"] = [end_id]
    _token_id(inputs, "pad_id")  # checked, unused
    kwargs["stop"] = parse_words(inputs.get("stop_words"), "stop_words")
    kwargs["bad_words"] = parse_words(inputs.get("bad_words"), "bad_words")
    cache_salt = _scalar(inputs, "cache_salt")
    if cache_salt is not None:
        kwargs["cache_salt"] = _text(cache_salt, "cache_salt")
    kwargs.update(_guide(inputs))
    prompt_logprobs = _prompt_logprobs(inputs)
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    skip_special = _scalar(inputs, "skip_special_tokens")
    if skip_special is not None:
        kwargs["skip_special_tokens"] = bool(skip_special)
    top = _num_top_logprobs(inputs)
    return_log_probs = bool(_scalar(inputs, "return_log_probs") or False) or top > 0
    if return_log_probs:
        kwargs["logprobs"] = top
    params = SamplingParams(**kwargs).validate()
    exclude = _scalar(inputs, "exclude_input_in_output")
    return GenerationRequest(
        prompt=prompt, params=params, stream=bool(_scalar(inputs, "stream") or False),
        exclude_input=exclude_input_default if exclude is None else bool(exclude),
        return_log_probs=return_log_probs, num_top_logprobs=top,
    )
