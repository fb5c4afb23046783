"""Request tensors (as the real client encodes them) → prompt + SamplingParams."""

from __future__ import annotations

import numpy as np
import pytest

from trtforge.model_repo.client import request_arrays
from trtforge.model_repo.metrics import time_per_output_token, time_to_first_token
from trtforge.model_repo.request import parse_request, parse_words


def test_defaults_are_greedy_and_stream_off():
    req = parse_request(request_arrays("Hello world", 7))
    assert req.prompt == "Hello world" and req.params.max_tokens == 7
    assert req.params.is_greedy and not req.stream and not req.return_log_probs
    assert not req.exclude_input
    assert parse_request(request_arrays("x", 1), exclude_input_default=True).exclude_input


def test_sampling_inputs_map_to_params():
    req = parse_request(request_arrays(
        "café", 9, temperature=0.5, top_k=3, top_p=0.9, seed=2**63 + 5, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=2, end_id=7,
        return_log_probs=True, stream=True, exclude_input_in_output=True))
    p = req.params
    assert req.prompt == "café"
    assert (p.temperature, p.top_k, p.seed, p.min_tokens) == (0.5, 3, 2**63 + 5, 2)
    assert p.top_p == pytest.approx(0.9) and p.repetition_penalty == pytest.approx(1.2)
    assert p.stop_token_ids == [7] and p.logprobs == 0
    assert parse_request(request_arrays("x", 2, end_id=0, pad_id=0)).params.stop_token_ids == [0]
    assert req.stream and req.return_log_probs and req.exclude_input


def test_num_top_logprobs_asks_for_alternatives_and_is_bounded():
    req = parse_request(request_arrays("x", 2, num_top_logprobs=5))
    assert (req.return_log_probs, req.num_top_logprobs, req.params.logprobs) == (True, 5, 5)
    req = parse_request(request_arrays("x", 2, num_top_logprobs=0, return_log_probs=True))
    assert (req.return_log_probs, req.num_top_logprobs, req.params.logprobs) == (True, 0, 0)
    assert parse_request(request_arrays("x", 2, num_top_logprobs=0)).params.logprobs is None
    for bad in (21, -1):
        with pytest.raises(ValueError, match=r"num_top_logprobs=.* send an integer 0..20"):
            parse_request(request_arrays("x", 2, num_top_logprobs=bad))


def test_top_p_zero_means_no_filter_as_in_tensorrt_llm():
    assert parse_request(request_arrays("x", 2, top_p=0.0)).params.top_p == 1.0


def test_timeout_s_is_a_deadline_and_zero_means_none():
    assert parse_request(request_arrays("x", 2, timeout_s=0.5)).params.timeout_s == 0.5
    assert parse_request(request_arrays("x", 2, timeout_s=0.0)).params.timeout_s is None
    assert parse_request(request_arrays("x", 2)).params.timeout_s is None


def test_cache_salt_is_passed_through_and_bounded():
    assert parse_request(request_arrays("x", 2, cache_salt="tenant-7")).params.cache_salt == "tenant-7"
    assert parse_request(request_arrays("x", 2, cache_salt="sel ü")).params.cache_salt == "sel ü"
    assert parse_request(request_arrays("x", 2)).params.cache_salt is None
    for bad in ("", "s" * 513):
        with pytest.raises(ValueError, match="cache_salt"):
            parse_request(request_arrays("x", 2, cache_salt=bad))


def test_stop_and_bad_words_are_csv_lines():
    req = parse_request(request_arrays("x", 2, stop_words=["foo,bar", "", '"a,b"'],
                                       bad_words="baz"))
    assert req.params.stop == ["foo", "bar", "a,b"]
    assert req.params.bad_words == ["baz"]
    assert parse_words(None, "stop_words") == []


def test_guided_decoding_inputs_become_the_guide():
    """TensorRT-LLM's structured-output inputs; an empty type is no constraint (an unset input)."""
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    p = parse_request(request_arrays("x", 2, guided_decoding_guide_type="json_schema",
                                     guided_decoding_guide=schema)).params
    assert (p.guided_decoding_guide_type, p.guided_decoding_guide, p.is_guided) == ("json_schema", schema, True)
    p = parse_request(request_arrays("x", 2, guided_decoding_guide_type="REGEX ",
                                     guided_decoding_guide="[a-z]+ ü")).params
    assert (p.guided_decoding_guide_type, p.guided_decoding_guide) == ("regex", "[a-z]+ ü")
    p = parse_request(request_arrays("x", 2, guided_decoding_guide_type="json", guided_decoding_guide="")).params
    assert (p.guided_decoding_guide_type, p.guided_decoding_guide) == ("json", "")
    p = parse_request(request_arrays("x", 2, guided_decoding_guide_type="", guided_decoding_guide="")).params
    assert not p.is_guided and p.guided_decoding_guide is None
    assert not parse_request(request_arrays("x", 2)).params.is_guided


@pytest.mark.parametrize("options, message", [
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"},
     "guided_decoding_guide_type='xml' is invalid: it must be None .*json, json_schema, regex"),
    ({"guided_decoding_guide_type": "json_schema"}, "guided_decoding_guide is missing"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": ""}, "guided_decoding_guide is missing"),
    ({"guided_decoding_guide": "[a-z]+"}, "without guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "r" * (64 * 1024 + 1)},
     "at most 65536 characters"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": ["a", "b"]}, "send one value per request"),
])
def test_bad_guided_decoding_inputs_say_what_is_wrong(options, message):
    with pytest.raises(ValueError, match=message):
        parse_request(request_arrays("x", 2, **options))


@pytest.mark.parametrize("arrays, message", [
    (request_arrays("x", 0), "max_tokens=0"),
    (request_arrays("x", 4, min_tokens=5), "min_tokens=5"),
    (request_arrays("x", 4, temperature=-1.0), "temperature"),
    (request_arrays("x", 4, beam_width=2), "beam_width=2 is not supported"),
    (request_arrays("x", 4, return_generation_logits=True), "return_generation_logits"),
    (request_arrays("x", 4, timeout_s=-1.0), "timeout_s=-1.0 is invalid"),
    (request_arrays("x", 4, end_id=-1), "end_id=-1 is invalid: it must be a token id >= 0"),
    (request_arrays("x", 4, pad_id=-5), "pad_id=-5 is invalid"),
    (request_arrays("x", 4, temperature=float("nan")), "SamplingParams.temperature=nan is invalid"),
    (request_arrays("x", 4, stop_words=[",".join(f"s{i}" for i in range(100))]),
     "SamplingParams.stop=.*at most 64 non-empty strings"),
    (request_arrays("x", 4, stop_words=["x" * 5000]), "at most 1024 characters each"),
    (request_arrays("x", 4, bad_words=["w" * 300]), "SamplingParams.bad_words=.*at most 128 characters"),
    ({"text_input": np.array([[b"x"]], dtype=object)}, "max_tokens is required"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=object),
      "max_tokens": np.array([[1], [1]], dtype=np.int32)}, "one prompt per request"),
    ({"text_input": np.array([[b"\xff"]], dtype=object),
      "max_tokens": np.array([[1]], dtype=np.int32)}, "not valid UTF-8"),
])
def test_bad_requests_say_what_is_wrong(arrays, message):
    with pytest.raises(ValueError, match=message):
        parse_request(arrays)


def test_client_rejects_unknown_inputs():
    with pytest.raises(ValueError, match="unknown ensemble input 'best_of'"):
        request_arrays("x", 1, best_of=2)


class _Times:
    arrival_time = 10.0
    first_token_time = 10.5
    finished_time = 12.5


def test_ttft_and_tpot_follow_vllm_definitions():
    assert time_to_first_token(_Times()) == pytest.approx(0.5)
    assert time_per_output_token(_Times(), 5) == pytest.approx(0.5)  # 2 s over 4 gaps
    assert time_per_output_token(_Times(), 1) is None


def test_prompt_logprobs_and_skip_special_tokens_inputs():
    req = parse_request(request_arrays("x", 2, prompt_logprobs=3, skip_special_tokens=False))
    assert (req.prompt_logprobs, req.params.prompt_logprobs, req.params.skip_special_tokens) == (3, 3, False)
    assert req.params.logprobs is None  # the generated tokens' are asked separately
    plain = parse_request(request_arrays("x", 2))
    assert (plain.prompt_logprobs, plain.params.skip_special_tokens) == (None, True)
    assert parse_request(request_arrays("x", 2, prompt_logprobs=0)).prompt_logprobs == 0
    for bad in (21, -1):
        with pytest.raises(ValueError, match=r"prompt_logprobs=.* is invalid: send an integer 0..20"):
            parse_request(request_arrays("x", 2, prompt_logprobs=bad))
