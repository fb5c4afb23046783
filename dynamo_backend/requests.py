"""Dynamo's request dict (the Rust preprocessor's PreprocessedRequest) → SamplingParams.

The frontend has already tokenized the prompt and applies stop strings and detokenization itself
(it streams our token ids back through its own detokenizer), so stop *strings* are not ours; stop
token ids, EOS handling and every sampling option are. A field we cannot honour is refused by
name (ValueError → the request alone fails with InvalidArgument), never ignored.
"""

from __future__ import annotations

import json
import math
from typing import Any

from trtforge.config.sampling import SamplingParams

_SAMPLING = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
             "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}
"""sampling_options keys that map one to one onto SamplingParams fields."""
_IGNORED_SAMPLING = {"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
                     "include_stop_str_in_output": None}
"""sampling_options keys we accept only at their neutral value (anything else is refused)."""
MAX_PROMPT_TOKENS = 1 << 20
"""Longest token list read from a request (the engine then checks max_seq_len)."""


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} is not a number")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name}={value!r} is not an integer")
        return int(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not finite")
    return float(value)


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_PROMPT_TOKENS or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{name} must be a list of at most {MAX_PROMPT_TOKENS} token ids")
    return value


def prompt_token_ids(request: dict[str, Any]) -> list[int]:
    ids = _token_ids("token_ids", request.get("token_ids"))
    if not ids:
        raise ValueError("token_ids is empty: at least one prompt token is needed")
    return ids


def _sampling_fields(sampling: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in sampling.items():
        if value is None:
            continue
        if key in _SAMPLING:
            fields[key] = _number(key, value, _SAMPLING[key])
        elif key == "guided_decoding":
            kind, guide = guided_decoding(value)
            fields["guided_decoding_guide_type"], fields["guided_decoding_guide"] = kind, guide
        elif key in _IGNORED_SAMPLING:
            neutral = _IGNORED_SAMPLING[key]
            if neutral is not None and value != neutral:
                raise ValueError(f"{key}={value!r} is not supported by this worker (send {neutral!r})")
    return fields


_GUIDE_KEYS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


def guided_decoding(spec: Any) -> tuple[str, str | None]:
    """Dynamo's guided_decoding (vLLM's shape: exactly one of json, regex, choice, grammar,
    structural_tag) → our (guided_decoding_guide_type, guided_decoding_guide); the engine compiles
    it at admission (a grammar that cannot compile fails this request alone)."""
    if not isinstance(spec, dict):
        raise ValueError("guided_decoding must be an object")
    given = [k for k in _GUIDE_KEYS if spec.get(k) not in (None, False, [])]
    unknown = sorted(k for k, v in spec.items() if v is not None and k not in (*_GUIDE_KEYS, "backend"))
    if unknown:
        raise ValueError(f"guided_decoding: {', '.join(unknown)} not supported by this worker")
    if spec.get("backend") not in (None, "xgrammar", "auto"):
        raise ValueError(f"guided_decoding.backend={spec['backend']!r}: this worker uses xgrammar")
    if len(given) != 1:
        raise ValueError(f"guided_decoding takes exactly one of {', '.join(_GUIDE_KEYS)} (got {given or 'none'})")
    key, value = given[0], spec[given[0]]
    if key == "json_object":
        return "json", None
    if key in ("json", "structural_tag"):
        text = value if isinstance(value, str) else json.dumps(value)
        return ("json_schema" if key == "json" else "structural_tag"), text
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise ValueError("guided_decoding.choice must be a list of non-empty strings")
        # Each alternative a string literal, escaped as JSON escapes strings (xgrammar's EBNF reads them so).
        return "ebnf_grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str):
        raise ValueError(f"guided_decoding.{key} must be a string")
    return ("regex" if key == "regex" else "ebnf_grammar"), value


def _stop_fields(stop: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    max_tokens = stop.get("max_tokens")
    fields: dict[str, Any] = {
        "max_tokens": default_max_tokens if max_tokens is None else _number("max_tokens", max_tokens, int)}
    if stop.get("min_tokens") is not None:
        fields["min_tokens"] = _number("min_tokens", stop["min_tokens"], int)
    if stop.get("ignore_eos") is not None:
        fields["ignore_eos"] = bool(stop["ignore_eos"])
    # The hidden ones are the model's EOS ids (generation_config.json): ignore_eos drops them.
    ids = _token_ids("stop_token_ids", stop.get("stop_token_ids") or [])
    if not fields.get("ignore_eos"):
        ids = ids + _token_ids("stop_token_ids_hidden", stop.get("stop_token_ids_hidden") or [])
    if ids:
        fields["stop_token_ids"] = sorted(set(ids))
    return fields


def sampling_params(request: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams (validated as every entry point validates them)."""
    sampling, stop, output = ({} if request.get(k) is None else request[k]
                              for k in ("sampling_options", "stop_conditions", "output_options"))
    if not all(isinstance(d, dict) for d in (sampling, stop, output)):
        raise ValueError("sampling_options, stop_conditions and output_options must be objects")
    fields = {**_sampling_fields(sampling), **_stop_fields(stop, default_max_tokens)}
    if output.get("logprobs") is not None:
        fields["logprobs"] = _number("logprobs", output["logprobs"], int)
    salt = request.get("cache_salt") or (request.get("extra_args") or {}).get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        fields["cache_salt"] = salt
    params = SamplingParams(**fields)
    params.validate()
    return params
