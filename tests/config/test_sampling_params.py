"""SamplingParams: defaults, validation messages, bad-word resolution with a real tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.tokenizers import byte_level_tokenizer
from trtforge.config.sampling import SamplingParams


def test_defaults_are_valid_greedy():
    params = SamplingParams().validate()
    assert params.is_greedy and not params.has_penalties
    assert params.max_tokens == 16 and params.logprobs is None and params.stop == []


def test_every_field_is_documented():
    import ast
    import inspect

    from trtforge.config import sampling as sampling_params

    tree = ast.parse(inspect.getsource(sampling_params))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    documented = {
        a.target.id for a, b in zip(cls.body, cls.body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_k", -2), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
    ("min_p", 1.1), ("seed", -1), ("seed", 1 << 64), ("seed", 1.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17), ("logprobs", -1),
    ("stop_token_ids", [1, -2]), ("stop", "###"), ("stop", [""]), ("bad_words", [3]),
    ("bad_words_ids", [[]]), ("bad_words_ids", [[1, "a"]]), ("top_k", True),
    ("temperature", float("inf")), ("temperature", 1e300), ("repetition_penalty", 0.001),
    ("repetition_penalty", 1e300), ("presence_penalty", float("nan")), ("logprobs", 21),
    ("ignore_eos", "yes"), ("skip_special_tokens", None), ("include_stop_str_in_output", 1),
    ("cache_salt", ""), ("cache_salt", 7), ("cache_salt", ["a"]),
    ("guided_decoding_guide_type", "xml"), ("guided_decoding_guide_type", ["json"]), ("guided_decoding_guide", 7),
])
def test_validate_names_field_and_value(field, value):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(ValueError) as err:
        params.validate()
    message = str(err.value)
    assert f"SamplingParams.{field}={value!r}" in message and "must be" in message


@pytest.mark.parametrize("field, value, bound", [
    ("stop", ["x"] * 65, "at most 64 non-empty strings"), ("stop", ["x" * 1025], "1024 characters"),
    ("stop_token_ids", list(range(1025)), "at most 1024"), ("bad_words", ["w"] * 257, "at most 256"),
    ("bad_words", ["w" * 129], "at most 128 characters"), ("bad_words_ids", [[1]] * 513, "at most 512"),
    ("bad_words_ids", [[1] * 1025], "1 to 1024"), ("cache_salt", "s" * 513, "at most 512 characters"),
    ("guided_decoding_guide", "g" * (64 * 1024 + 1), "at most 65536 characters"),
])
def test_sizes_are_bounded(field, value, bound):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(ValueError) as err:
        params.validate()
    message = str(err.value)
    assert message.startswith(f"SamplingParams.{field}=") and bound in message and len(message) < 600


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_k", -1), ("top_k", 40), ("top_p", 1.0), ("min_p", 0.05),
    ("seed", (1 << 64) - 1), ("seed", 0), ("min_tokens", 16), ("logprobs", 0), ("logprobs", 5),
    ("stop", ["\n\n", "User:"]), ("bad_words_ids", [[3, 4]]),
    ("stop", ["x" * 1024] * 64), ("stop_token_ids", list(range(1024))), ("logprobs", 20),
    ("bad_words_ids", [[1] * 1024] * 512), ("repetition_penalty", 0.01), ("repetition_penalty", 100.0),
    ("temperature", 1e-6),
])
def test_validate_accepts_edge_values(field, value):
    dataclasses.replace(SamplingParams(), **{field: value}).validate()


def test_resolve_bad_words_with_and_without_leading_space():
    tok = byte_level_tokenizer()
    params = SamplingParams(bad_words=["world", "中文"]).resolve_bad_words(tok)
    expected = [tok.encode(w, add_special_tokens=False) for w in ["world", " world", "中文", " 中文"]]
    assert sorted(params.bad_words_ids) == sorted(expected)
    assert any(len(ids) > 1 for ids in params.bad_words_ids)  # multi-token words are kept whole
    params.resolve_bad_words(tok)  # idempotent
    assert sorted(params.bad_words_ids) == sorted(expected)
    params.validate()


def test_hostile_sizes_are_named_without_echoing_them_whole():
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["x" * (1 << 20)]).validate()
    message = str(err.value)
    assert message.startswith("SamplingParams.stop=['xxxx") and len(message) < 600
    assert "1048580 characters" in message and "at most 1024 characters" in message
    with pytest.raises(ValueError, match=r"SamplingParams.stop=.*5000 items.*at most 64 non-empty"):
        SamplingParams(stop=[f"s{i}" for i in range(5000)]).validate()


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams(temperature=1e-5).is_greedy


def test_check_vocab_names_the_field_and_the_id():
    SamplingParams(stop_token_ids=[0, 99], bad_words_ids=[[5, 99]]).check_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids contains 100, outside this model's "
                                         r"vocabulary of 100 tokens.*end_id.*0\.\.99"):
        SamplingParams(stop_token_ids=[7, 100]).check_vocab(100)
    with pytest.raises(ValueError, match=r"bad_words_ids contains \[5, 1000000000\] with token id "
                                         r"1000000000"):
        SamplingParams(bad_words_ids=[[3], [5, 10**9]]).check_vocab(100)


def test_resolved_bad_words_stay_valid():
    tok = byte_level_tokenizer()
    words = [f"{i}中文" * 25 for i in range(256)]  # 128+ characters of up to 3 bytes each
    words = [w[:128] for w in words]
    params = SamplingParams(bad_words=words, bad_words_ids=[[1]] * 512).validate()
    params.resolve_bad_words(tok)
    assert len(params.bad_words_ids) > 512 and max(len(s) for s in params.bad_words_ids) > 64
    params.validate()  # the sampler checks resolved parameters again
